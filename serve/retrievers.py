"""The retrieval deployments agent mode calls: the text index (`actors.retriever`) and CDIR's image index
(`indexing.image_index`), each a Serve deployment that scales and restarts with the app."""
from __future__ import annotations

import ray
from ray import serve

from indexing.retrieval_index import read_manifest
from actors.retriever import LocalRetriever, ShardedRetriever
from cluster.devices import pin_threads


# A replica whose constructor fails (the app builder checked what it could) fails its deployment after one retry, so
# `serve run` stops with the error instead of restarting replicas for minutes.
CONSTRUCTOR_RETRIES = 1


def assigned_threads() -> int:
    """The CPUs Serve gave this replica, at least one."""
    return max(1, round(ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)))


@serve.deployment(name="Retriever", ray_actor_options={"num_cpus": 0.5}, health_check_period_s=30,
                  max_constructor_retry_count=CONSTRUCTOR_RETRIES)
class RetrieverServer:
    """`actors.retriever` over one index (a sharded one through one actor per shard) as a Serve deployment, so it
    scales and restarts with the app."""

    def __init__(self, index_dir: str, retrieval: dict):
        threads = assigned_threads()
        pin_threads(threads)
        sharded = "shards" in read_manifest(index_dir)
        self.retriever = (ShardedRetriever(index_dir, threads=threads, config=retrieval) if sharded
                          else LocalRetriever(index_dir, config=retrieval))

    def search(self, queries: list[str], top_k: int, among: list[list[str] | None] | None = None) -> list[list[dict]]:
        return self.retriever.search(queries, top_k, among)

    def ready(self) -> bool:
        """Answered once the index is loaded (the constructor has returned)."""
        return True


@serve.deployment(name="ImageRetriever", ray_actor_options={"num_cpus": 0.25}, health_check_period_s=30,
                  max_constructor_retry_count=CONSTRUCTOR_RETRIES)
class ImageRetrieverServer:
    """CDIR's image-caption index (`indexing.image_index`, BiomedCLIP image cosine) as a Serve deployment: the most
    similar cases of an agent request's image."""

    def __init__(self, index_dir: str):
        from actors.image_retriever import LocalImageRetriever  # open_clip (heavy, the vision extra) loads only for CDIR

        pin_threads(assigned_threads())
        self.retriever = LocalImageRetriever(index_dir)

    def search(self, images: list, top_k: int) -> list[list[dict]]:
        return self.retriever.search(images, top_k)

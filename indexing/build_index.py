"""Build a retrieval index from a knowledge base: encode its chunks in batches, then write FAISS + BM25 + documents.

    python -m indexing.build_index --kb hpo --out DIR [--encoder minilm|MODEL_DIR] [--index flat|hnsw|ivfpq]
                                 [--shards N] [--batch-size 64] [--threads N] [--hnsw-m 32 --nprobe 32 ...]

``--kb`` is a chunks JSONL (fields id, doc_id, title, text, source) or ``hpo`` for the HPO world's knowledge base.
Encoding dominates the build's time: on a few CPU cores the whole HPO knowledge base takes tens of minutes
(docs/BENCHMARKS.md, *Speed*).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

from indexing.encoders import Encoder, load_encoder
from indexing.retrieval_index import (IndexConfig, IndexMismatchError, check_manifest, read_manifest, resolve_corpus,
                                    write_index)
from tasks.extras import require
from cluster.files import cache_dir, file_lock, sha256_file


CHUNK_FIELDS = ("id", "doc_id", "title", "text", "source")


def default_index_dir(kb: str, kind: str, shards: int) -> Path:
    """Where the index of knowledge base `kb` is cached: one directory per corpus path, kind and shard count."""
    tag = hashlib.sha256(str(Path(kb).resolve()).encode() if kb != "hpo" else b"hpo").hexdigest()[:10]
    return cache_dir() / "indexes" / f"{Path(kb).stem}-{kind}-{shards}shard-{tag}"


def read_chunks(path: str | os.PathLike) -> list[dict]:
    """The chunk records of a knowledge-base JSONL, in file order (the order of the index's rows); a line that is not
    UTF-8 JSON with every field of CHUNK_FIELDS raises ValueError naming the file, the line and the field."""
    chunks = []
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                chunk = json.loads(raw.decode("utf-8")) if raw.strip() else None
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}:{lineno}: not a UTF-8 JSON line ({e})") from None
            if chunk is None:
                continue
            missing = [f for f in CHUNK_FIELDS if not isinstance(chunk, dict) or not isinstance(chunk.get(f), str)]
            if missing:
                raise ValueError(f"{path}:{lineno}: field {missing[0]!r}: missing or not a string "
                                 f"(a chunk has {', '.join(CHUNK_FIELDS)})")
            chunks.append(chunk)
    return chunks


def build_index(kb: str | os.PathLike, out_dir: str | os.PathLike, encoder: Encoder | str = "minilm",
                config: IndexConfig | None = None, shards: int = 1, batch_size: int = 64,
                progress: bool = True) -> dict:
    """Encode every chunk of ``kb`` with ``encoder`` and write the index to ``out_dir``; return its manifest.

    The manifest records the encoder's source (an alias resolves to each machine's own cached copy) and its checksum,
    which is what loading compares. With ``config.kind == "none"`` nothing is encoded (a BM25-only index).
    """
    config = config or IndexConfig()
    corpus_path = resolve_corpus(kb)
    chunks = read_chunks(corpus_path)
    vectors, identity, extra = None, None, {}
    if config.kind != "none":
        if not isinstance(encoder, Encoder):
            encoder = load_encoder(encoder)
        started = time.perf_counter()
        vectors = encoder.encode([chunk["text"] for chunk in chunks], batch_size=batch_size, progress=progress)
        seconds = time.perf_counter() - started
        identity = encoder.identity
        extra["encoding"] = {"seconds": round(seconds, 2), "chunks_per_s": round(len(chunks) / seconds, 2),
                             "batch_size": batch_size, "device": encoder.device, "threads": _torch_threads()}
    return write_index(out_dir, chunks, vectors, encoder_identity=identity,
                       corpus={"source": str(corpus_path), "sha256": sha256_file(corpus_path)},
                       config=config, shards=shards, extra=extra, progress=progress)


def ensure_index(kb: str | os.PathLike, out_dir: str | os.PathLike, encoder: Encoder | str = "minilm",
                 config: IndexConfig | None = None, shards: int = 1, batch_size: int = 64,
                 progress: bool = False) -> dict:
    """The manifest of the index in ``out_dir``, (re)building it first unless it was built from this corpus, with this
    encoder, index settings and shard count. Safe to call from several processes at once (a file lock)."""
    config = config or IndexConfig()
    if config.kind != "none" and not isinstance(encoder, Encoder):
        encoder = load_encoder(encoder)
    identity = encoder.identity if isinstance(encoder, Encoder) else None
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(out.with_name(f".{out.name}.lock")):
        try:
            manifest = read_manifest(out)
            check_manifest(manifest, out, identity, sha256_file(resolve_corpus(kb)))
            current = manifest["index"] == config.model_dump() and len(manifest.get("shards", [None])) == shards \
                and (manifest["encoder"] is None) == (identity is None)
        except (FileNotFoundError, IndexMismatchError):
            current = False
        if not current:
            manifest = build_index(kb, out, encoder, config, shards=shards, batch_size=batch_size, progress=progress)
    return manifest


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m indexing.build_index", description=__doc__.split("\n\n")[0])
    parser.add_argument("--kb", required=True, help="chunks JSONL, or 'hpo' for the HPO world's knowledge base")
    parser.add_argument("--out", required=True, type=Path, help="index directory (replaced if it exists)")
    parser.add_argument("--encoder", default="minilm", help="local HF / sentence-transformers model dir, or 'minilm'")
    parser.add_argument("--index", default="flat", choices=["flat", "hnsw", "ivfpq", "none"],
                        help="dense index kind; none: BM25 only, nothing encoded")
    parser.add_argument("--shards", type=int, default=1, help="split into N shards, one Retriever actor each")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch / FAISS threads (default: all cores)")
    for name, field in IndexConfig.model_fields.items():
        if name == "kind":
            continue
        flag = f"--{name.replace('_', '-')}"
        if field.annotation is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=field.description)
        else:
            parser.add_argument(flag, type=int, default=None, help=f"{field.description} (default {field.default})")
    args = parser.parse_args(argv)
    if args.threads:
        faiss = require("faiss", "medical")
        import torch

        torch.set_num_threads(args.threads)
        faiss.omp_set_num_threads(args.threads)
    overrides = {name: getattr(args, name) for name in IndexConfig.model_fields if name != "kind"}
    config = IndexConfig(kind=args.index, **{k: v for k, v in overrides.items() if v is not None})
    manifest = build_index(args.kb, args.out, args.encoder, config, shards=args.shards, batch_size=args.batch_size)
    encoded = f", encoded at {manifest['encoding']['chunks_per_s']} chunks/s" if "encoding" in manifest else ""
    print(f"wrote {args.out}: {manifest['corpus']['chunks']} chunks, {args.index} index, "
          f"{len(manifest.get('shards', [])) or 1} shard(s){encoded}")


if __name__ == "__main__":
    main()

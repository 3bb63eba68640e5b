"""The image index for CDIR (Med-RwR sec. 3.3, appendix D.2.2): BiomedCLIP embeddings of an image-caption corpus in an
exact FAISS inner-product index, built and checked here; `actors.image_retriever` searches it.

    python -m indexing.image_index [--corpus cdir_corpus.jsonl] --out DIR [--clip BIOMEDCLIP_DIR] [--batch-size 32]

The corpus is a JSONL of ``{id, image, caption}`` records, ``image`` a path relative to the corpus file's directory
(the imaging world's ``cdir_corpus.jsonl``, the default, built on first use by :mod:`tasks.build_imaging`). The
index directory holds::

    manifest.json   format, encoder identity (BiomedCLIP weights checksum) and directory, corpus checksum, counts
    docs.jsonl      the corpus rows (memory-mapped with offsets.npy, as the text index's document store)
    offsets.npy
    images.faiss    IndexFlatIP over L2-normalised image embeddings: inner product = cosine, exact

The corpus checksum covers the JSONL and every image it names, so an index is refused (:class:`IndexMismatchError`)
when it was built with other weights or when any caption or image has changed since.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

from indexing.retrieval_index import DocStore, IndexConfig, IndexMismatchError, build_dense_index, read_manifest
from tasks.extras import require
from cluster.files import building_dir, cache_dir, file_lock
from tasks.image_corpus import default_corpus, read_image_corpus

IMAGE_INDEX_FORMAT = 1
MANIFEST = "manifest.json"


def corpus_sha256(path: str | os.PathLike, rows: list[dict] | None = None) -> str:
    """sha256 over the corpus JSONL's bytes and then the bytes of every image it names, in file order."""
    digest = hashlib.sha256()
    for file in [Path(path)] + [Path(r["image_path"]) for r in rows or read_image_corpus(path)]:
        digest.update(file.read_bytes())
    return digest.hexdigest()


def load_images(images: list) -> list:
    """PIL images, or paths to image files, as RGB PIL images."""
    from PIL import Image
    return [im.convert("RGB") if isinstance(im, Image.Image) else Image.open(im).convert("RGB") for im in images]


def embed_corpus_images(model, rows: list[dict], batch_size: int = 32, progress: bool = True) -> np.ndarray:
    """(n, d) float32 unit rows: the BiomedCLIP image embedding of every corpus image, in batches, with a bar."""
    from tqdm import tqdm
    parts = []
    with tqdm(total=len(rows), desc="embed images", unit="img", disable=not progress) as bar:
        for start in range(0, len(rows), batch_size):
            batch = rows[start:start + batch_size]
            parts.append(model.embed_images(load_images([r["image_path"] for r in batch])))
            bar.update(len(batch))
    return np.concatenate(parts).astype(np.float32)


def build_image_index(out_dir: str | os.PathLike, corpus: str | os.PathLike | None = None, model=None,
                      clip_path: str | None = None, batch_size: int = 32, progress: bool = True) -> dict:
    """Embed every corpus image with BiomedCLIP (``model``, else loaded from ``clip_path``; None: the tiny one) and
    write the index; returns its manifest. Written to a temporary sibling and renamed: never found half-written."""
    faiss = require("faiss", "medical")

    from indexing.biomedclip import load_biomedclip

    corpus = Path(corpus) if corpus is not None else default_corpus()
    rows = read_image_corpus(corpus)
    model = model or load_biomedclip(clip_path)
    started = time.perf_counter()
    vectors = embed_corpus_images(model, rows, batch_size, progress)
    seconds = time.perf_counter() - started
    manifest = {"format": IMAGE_INDEX_FORMAT, "kind": "image",
                # the directory of the encoder used, however it was given (model or clip_path), so a retriever
                # opening this index loads that encoder and not the tiny default
                "encoder": {"identity": model.identity, "path": str(model.model_dir), "dim": int(vectors.shape[1])},
                "corpus": {"source": str(corpus.resolve()), "sha256": corpus_sha256(corpus, rows), "rows": len(rows)},
                "encoding": {"seconds": round(seconds, 2), "images_per_s": round(len(rows) / seconds, 2),
                             "batch_size": batch_size, "device": model.device},
                "versions": {"faiss": faiss.__version__}}
    with building_dir(out_dir, replace=True) as tmp:
        DocStore.write(tmp, rows)
        faiss.write_index(build_dense_index(vectors, IndexConfig(kind="flat")), str(tmp / "images.faiss"))
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_image_manifest(index_dir: str | os.PathLike) -> dict:
    path = Path(index_dir) / MANIFEST
    manifest = read_manifest(index_dir, "an image index", f"python -m indexing.image_index --out {index_dir}")
    if manifest.get("kind") != "image":
        raise IndexMismatchError(f"{path}: field 'kind' is {manifest.get('kind')!r}, not 'image' (a text retrieval "
                                 f"index? those are searched by actors.retriever)")
    return manifest


def check_image_manifest(manifest: dict, index_dir: str | os.PathLike, encoder_identity: str | None,
                         corpus_checksum: str | None = None) -> None:
    """Raise :class:`IndexMismatchError` unless the index has this format, was embedded by the BiomedCLIP weights
    ``encoder_identity`` names (None: not compared, no encoder is loaded yet) and, when ``corpus_checksum`` is given,
    from that corpus (captions and images)."""
    rebuild = f"rebuild it with: python -m indexing.image_index --out {index_dir} [--corpus ...] [--clip ...]"
    if manifest.get("format") != IMAGE_INDEX_FORMAT:
        raise IndexMismatchError(f"image index {index_dir} has format {manifest.get('format')}, this medray reads "
                                 f"{IMAGE_INDEX_FORMAT}; {rebuild}")
    if encoder_identity is not None and manifest["encoder"]["identity"] != encoder_identity:
        raise IndexMismatchError(f"image index {index_dir} was embedded with {manifest['encoder']['identity']} but "
                                 f"the given encoder is {encoder_identity}; {rebuild}")
    if corpus_checksum is not None and manifest["corpus"]["sha256"] != corpus_checksum:
        raise IndexMismatchError(f"image index {index_dir} was built from {manifest['corpus']['source']} (sha256 "
                                 f"{manifest['corpus']['sha256'][:12]}...) but the given corpus (captions and images) "
                                 f"has sha256 {corpus_checksum[:12]}...; {rebuild}")


def check_image_index(index_dir: str | os.PathLike) -> None:
    """What :class:`LocalImageRetriever` opens of the image index in `index_dir`, checked without loading it: an image
    index manifest in this format, the rows, the FAISS index and the BiomedCLIP directory it was embedded with.
    Raises FileNotFoundError or IndexMismatchError naming what is wrong."""
    manifest = read_image_manifest(index_dir)
    check_image_manifest(manifest, index_dir, None)
    missing = [name for name in ("docs.jsonl", "offsets.npy", "images.faiss") if not (Path(index_dir) / name).exists()]
    if missing:
        raise FileNotFoundError(f"image index {index_dir} has no {', '.join(missing)}; rebuild it with python -m "
                                f"indexing.image_index --out {index_dir}")
    encoder = manifest["encoder"]["path"]
    if not Path(encoder).is_dir():
        raise FileNotFoundError(f"image index {index_dir} was embedded with BiomedCLIP {encoder}, which is not a "
                                f"directory here")


def default_index_dir(encoder_identity: str) -> Path:
    return cache_dir() / "indexes" / f"cdir-{encoder_identity.replace(':', '-')}"


def ensure_image_index(out_dir: str | os.PathLike | None = None, corpus: str | os.PathLike | None = None,
                       model=None, clip_path: str | None = None, batch_size: int = 32,
                       progress: bool = False) -> Path:
    """The image index directory (default: under medray's cache, one per encoder), (re)built first unless its
    manifest matches this encoder and this corpus. Safe to call from several processes at once (a file lock)."""
    from indexing.biomedclip import load_biomedclip

    model = model or load_biomedclip(clip_path)
    corpus = Path(corpus) if corpus is not None else default_corpus()
    out = Path(out_dir) if out_dir is not None else default_index_dir(model.identity)
    out.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(out.with_name(f".{out.name}.lock")):
        try:
            check_image_manifest(read_image_manifest(out), out, model.identity, corpus_sha256(corpus))
        except (FileNotFoundError, IndexMismatchError):
            build_image_index(out, corpus, model, clip_path, batch_size, progress)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m indexing.image_index", description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=None, help="image-caption JSONL (default: the imaging world's)")
    parser.add_argument("--out", type=Path, default=None, help="index directory (default: under medray's cache)")
    parser.add_argument("--clip", default=None, help="local BiomedCLIP open_clip directory (default: the tiny one)")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args(argv)
    from indexing.biomedclip import load_biomedclip

    model = load_biomedclip(args.clip)
    out = args.out or default_index_dir(model.identity)
    manifest = build_image_index(out, args.corpus, model, args.clip, args.batch_size, progress=True)
    print(f"wrote {out}: {manifest['corpus']['rows']} images embedded by {model.identity} at "
          f"{manifest['encoding']['images_per_s']} images/s")


if __name__ == "__main__":
    main()

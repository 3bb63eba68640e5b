"""BiomedCLIP throughput: images/s and texts/s at batch sizes 1, 16 and 64 (the tiny BiomedCLIP-architecture model
unless --clip names a real one).

    python benchmarks/bench_clip.py [--clip DIR] [--batches 1,16,64] [--repeats 3] [--threads 2]

Images are the imaging world's CDIR corpus images (448 px PNGs, decoded once up front; the timing covers BiomedCLIP's
preprocessing, 224 px resize and normalisation, and the forward pass); texts are their captions (BiomedCLIP's
tokenizer pads to 256 tokens). Each row is the best of --repeats passes over --items items. Prints a table and writes
benchmarks/results/clip.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from actors.biomedclip import load_biomedclip  # noqa: E402
from actors.image_index import default_corpus, load_images, read_image_corpus  # noqa: E402
from benchmarks.common import report  # noqa: E402


def throughput(fn, items: list, batch_size: int, repeats: int) -> float:
    """Items per second of `fn` over `items` in batches of `batch_size`, best of `repeats` passes."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(0, len(items), batch_size):
            fn(items[i:i + batch_size])
        best = min(best, time.perf_counter() - start)
    return len(items) / best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clip", default=None, help="local BiomedCLIP open_clip directory (default: the tiny one)")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--items", type=int, default=64, help="images (and texts) per pass")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    model = load_biomedclip(args.clip)
    corpus = read_image_corpus(default_corpus())[:args.items]
    images = load_images([r["image_path"] for r in corpus])
    captions = [r["caption"] for r in corpus]
    model.embed_images(images[:2]), model.embed_texts(captions[:2])  # warm-up
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        model.batch_size = batch
        rows.append({"batch": batch, "images_per_s": throughput(model.embed_images, images, batch, args.repeats),
                     "texts_per_s": throughput(model.embed_texts, captions, batch, args.repeats),
                     "items": len(images), "threads": args.threads, "device": model.device,
                     "load_avg_1m": round(os.getloadavg()[0], 2), "model": model.identity,
                     "parameters": sum(p.numel() for p in model.model.parameters())})
    report("clip", rows)  # load_avg_1m: the machine's load while measuring (its cores may be shared)


if __name__ == "__main__":
    main()

"""BiomedCLIP throughput: images/s and texts/s at batch sizes 1, 16 and 64 (the tiny BiomedCLIP-architecture model
unless --clip names a real one).

    python benchmarks/bench_clip.py [--clip DIR] [--batches 1,16,64] [--repeats 3] [--threads 2] [--cdir-images 150]

Images are the imaging world's CDIR corpus images (448 px PNGs, decoded once up front; the timing covers BiomedCLIP's
preprocessing, 224 px resize and normalisation, and the forward pass); texts are their captions (BiomedCLIP's
tokenizer pads to 256 tokens). Each row is the best of --repeats passes over --items items.

Also what CDIR can add with this encoder: for --cdir-images test images of imaging:finding_mcq_test, whether the
nearest corpus case (the one CDIR shows the policy) has the image's finding, against a random corpus case of the same
modality. Prints a table and writes benchmarks/results/clip.json (the throughput rows and "cdir_neighbour").
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from indexing.biomedclip import load_biomedclip  # noqa: E402
from indexing.image_index import load_images  # noqa: E402
from tasks.image_corpus import default_corpus, read_image_corpus  # noqa: E402
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


def cdir_neighbour(model, n_images: int) -> dict:
    """Share of test images whose nearest CDIR corpus case names their finding (its HPO id in the caption), and the
    share expected of a random corpus case of the same modality."""
    from actors.image_retriever import LocalImageRetriever
    from indexing.image_index import ensure_image_index
    from learners.data import load_tasks
    tasks = load_tasks("imaging:finding_mcq_test")[:n_images]
    corpus = read_image_corpus(default_corpus())
    retriever = LocalImageRetriever(ensure_image_index(model=model), model=model)
    nearest = [hits[0] for hits in retriever.search([t["images"][0] for t in tasks], top_k=1)]
    nearest_hit = random_hit = 0.0
    for task, case in zip(tasks, nearest):
        finding, modality = task["metadata"]["hpo_id"], task["metadata"]["modality"]
        nearest_hit += finding in case["caption"]
        same_modality = [r for r in corpus if r["modality"] == modality]
        random_hit += sum(finding in r["caption"] for r in same_modality) / len(same_modality)
    return {"images": len(tasks), "nearest_has_finding": nearest_hit / len(tasks),
            "random_same_modality_has_finding": random_hit / len(tasks)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clip", default=None, help="local BiomedCLIP open_clip directory (default: the tiny one)")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--items", type=int, default=64, help="images (and texts) per pass")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cdir-images", type=int, default=150, help="test images for the CDIR neighbour check")
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
    path = report("clip", rows)  # load_avg_1m: the machine's load while measuring (its cores may be shared)
    neighbour = cdir_neighbour(model, args.cdir_images)
    print(f"CDIR nearest corpus case has the test image's finding: {neighbour['nearest_has_finding']:.2f} of "
          f"{neighbour['images']} (a random case of the same modality: {neighbour['random_same_modality_has_finding']:.2f})")
    path.write_text(json.dumps({**json.loads(path.read_text()), "cdir_neighbour": neighbour}, indent=1))


if __name__ == "__main__":
    main()

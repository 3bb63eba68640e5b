"""How much of a finding survives the policy's input size: what any tower could see, before one is trained.

    python benchmarks/bench_vision_input.py [--name vision_input] [--sizes 84 112 168 224] [--train-images 3000]

Each imaging-world image is shrunk to the input size (the image processor's bicubic resize) and every lesion's 3 x 3
cell is cut out (questions name a cell; every lesion lies inside one). A small CNN trained from scratch on the cells of
--train-images rendered training images names the finding of each cell of --test-images held-out (test-split)
images, among its modality's findings, as a finding question's options are. Rows: held-out accuracy by lesion size
with 95% Wilson intervals (chance: one of 4-5 findings). It bounds no tower from above (a deeper model or more data may
see more) but shows what the pixels still carry at each size for a model of a few seconds' training.
Prints a table and writes benchmarks/results/<name>.json.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import report  # noqa: E402
from learners.intervals import wilson_interval  # noqa: E402
from tasks.imaging import FINDINGS, FINDINGS_BY_KEY  # noqa: E402
from tasks.imaging.world import GRID  # noqa: E402
from tasks.vision_data import FINDING_INDEX  # noqa: E402

# per modality: the indices of its findings, the options a finding question offers
OPTIONS = {m: [FINDING_INDEX[f.key] for f in FINDINGS if f.modality == m] for m in {f.modality for f in FINDINGS}}


def cells(pool, size: int):
    """(cell crops [n, 3, side, side] in [0, 1], finding index, modality's finding indices, stratum) of every lesion in
    `pool`, each image shrunk to `size` first."""
    import numpy as np
    import torch
    from PIL import Image

    side = size // GRID
    crops, labels, allowed, strata = [], [], [], []
    for image, lesions in zip(pool.images, pool.lesions):
        small = np.asarray(image.resize((size, size), Image.BICUBIC), dtype=np.float32) / 255.0
        for les in lesions:
            row, col = les["cell"]
            top, left = round(row * size / GRID), round(col * size / GRID)
            crops.append(small[top:top + side, left:left + side])
            labels.append(FINDING_INDEX[les["finding"]])
            allowed.append(OPTIONS[FINDINGS_BY_KEY[les["finding"]].modality])
            strata.append(les["stratum"])
    return torch.tensor(np.stack(crops)).permute(0, 3, 1, 2), torch.tensor(labels), allowed, strata


def cnn(classes: int):
    """Four convolution stages (batch-normalised, each halving the cell), pooled: a receptive field that covers a
    large lesion at every size measured."""
    import torch.nn as nn
    layers, width = [], 3
    for out in (32, 64, 96, 128):
        layers += [nn.Conv2d(width, out, 3, padding=1), nn.BatchNorm2d(out), nn.GELU(), nn.MaxPool2d(2)]
        width = out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes))


def fit(x, y, epochs: int, seed: int, net=None, lr: float = 2e-3):
    """`net` (the CNN by default: cells centred in, one logit per finding out) trained with AdamW and a one-cycle
    schedule on (x, y) centred, flipped at random."""
    import torch
    torch.manual_seed(seed)
    rng = random.Random(seed)
    net = cnn(len(FINDINGS)) if net is None else net
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.01)
    steps = epochs * ((len(y) + 63) // 64)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps)
    net.train()
    for _ in range(epochs):
        order = torch.randperm(len(y))
        for b in range(0, len(y), 64):
            pick = order[b:b + 64]
            batch = x[pick] - 0.5
            for dim in (2, 3):
                if rng.random() < 0.5:
                    batch = batch.flip(dim)
            loss = torch.nn.functional.cross_entropy(net(batch), y[pick])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
    return net.eval()


def named_by_stratum(net, x, y, allowed, strata) -> dict[str, tuple[int, int]]:
    """Per lesion size: (cells whose finding `net` names among its modality's findings, cells)."""
    import torch
    with torch.no_grad():
        logits = torch.cat([net(x[i:i + 256] - 0.5) for i in range(0, len(y), 256)])
    mask = torch.full_like(logits, float("-inf"))
    for i, options in enumerate(allowed):
        mask[i, options] = 0.0
    right = (logits + mask).argmax(-1) == y
    out = {}
    for stratum in ("large", "small"):
        picked = [i for i, s in enumerate(strata) if s == stratum]
        out[stratum] = (int(right[picked].sum()), len(picked))
    return out


def main(argv: list[str] | None = None) -> int:
    import torch
    from tasks.hpo import load_hpo_snapshot
    from tasks.imaging import ImagingTaskBuilder
    from tasks.vision_data import render_pool

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="vision_input")
    parser.add_argument("--sizes", type=int, nargs="+", default=[84, 112, 168, 224])
    parser.add_argument("--train-images", type=int, default=3000)
    parser.add_argument("--test-images", type=int, default=600)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    builder = ImagingTaskBuilder(load_hpo_snapshot(), seed=0)
    train = render_pool(builder, "train", args.train_images, args.threads)
    test = render_pool(builder, "test", args.test_images, args.threads)
    rows = []
    for size in args.sizes:
        start = time.perf_counter()
        x, y, _, _ = cells(train, size)
        net = fit(x, y, args.epochs, seed=0)
        for stratum, (hits, n) in named_by_stratum(net, *cells(test, size)).items():
            low, high = wilson_interval(hits, n)
            rows.append({"input_px": size, "cell_px": size // GRID, "lesions": stratum, "n": n,
                         "named": f"{hits / n:.3f} [{low:.3f}, {high:.3f}]",
                         "train_cells": len(y), "seconds": round(time.perf_counter() - start, 1)})
        print(rows[-2], rows[-1], flush=True)
    report(args.name, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

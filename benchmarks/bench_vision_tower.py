"""What the seeing policy's tower learns from pre-training alone, per recipe variant, on images it never saw.

    python benchmarks/bench_vision_tower.py [--name vision_tower] [--val-images 500] \
        [--variant NAME:field=value,field=value ...]

Each variant is the build's VisionRecipe with some fields changed (`shipped` changes none). Its random tower is
pre-trained as the build's first stage does (tasks/vision_model.pretrain_tower), then a linear read-out fitted on its
frozen tokens of 1,000 training images names the finding under each token of --val-images images rendered from a
validation split (neither the training nor the test split, so a variant is never chosen on test images): large and
small lesion tokens apart (the large also among their modality's findings alone, as a question's options are), with
95% Wilson intervals, and the minutes pre-training took.

With --cells EPOCHS, each variant's random tower is instead trained the way bench_vision_input.py trains its CNN, on
the lesion cells of the training images cut out at the policy's input size (one merged token a cell), and names the
finding of each validation cell among its modality's findings; that CNN is trained and scored on the same cells in
the first row: the tower's architecture against a convolution's on one task, with nothing else (the rest of the
image, empty tokens, the read-out) in between. --conv-patches adds, after each variant, its tower with the patch
embedding a small CNN pooled over the patch (the recipe's `patch_embedding=conv`, tasks/vision_arch.py), in either
mode.
Prints a table and writes benchmarks/results/<name>.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_vision import fit_readout, share, token_features  # noqa: E402
from benchmarks.common import report  # noqa: E402

READOUT_IMAGES = 1000


def cell_patches(crops, image_processor, merge_size: int):
    """Cell crops ([n, 3, side, side] in [0, 1], side = patch x merge) as the tower's input: normalised as the
    policy's processor normalises, cut into each cell's merge x merge patches in raster order, each patch flattened
    as (channel, time, y, x) with the image repeated over the processor's two time steps."""
    import torch

    n, _, side, _ = crops.shape
    m, p = merge_size, side // merge_size
    mean = torch.tensor(image_processor.image_mean).view(1, 3, 1, 1)
    std = torch.tensor(image_processor.image_std).view(1, 3, 1, 1)
    x = ((crops - mean) / std).reshape(n, 3, m, p, m, p).permute(0, 2, 4, 1, 3, 5).unsqueeze(4)
    return x.expand(n, m, m, 3, image_processor.temporal_patch_size, p, p).reshape(n * m * m, -1)


def cell_tower(visual, image_processor):
    """`visual` as a classifier of cells (bench_vision_input's centred crops, one merged token's side): one logit per
    finding from each crop's merged token."""
    import torch
    from tasks.imaging import FINDINGS

    class CellTower(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.visual = visual
            self.head = torch.nn.Linear(visual.merger.mlp[-1].out_features, len(FINDINGS))

        def forward(self, centred):
            m = visual.spatial_merge_size
            grid = torch.tensor([[1, m, m]] * centred.shape[0])
            tokens = self.visual(cell_patches(centred + 0.5, image_processor, m), grid_thw=grid).pooler_output
            return self.head(tokens)

    return CellTower()


def on_cells(name: str, net, lr: float, train_cells, val_cells, epochs: int) -> dict:
    """A row: `net` (None: bench_vision_input's CNN) trained as that benchmark trains its CNN on `train_cells`, then
    the share of `val_cells` whose finding it names among the modality's findings, by lesion size."""
    from benchmarks.bench_vision_input import fit, named_by_stratum

    started = time.perf_counter()
    net = fit(*train_cells[:2], epochs, seed=0, net=net, lr=lr)
    row = {"variant": name, "cells training min": round((time.perf_counter() - started) / 60, 1)}
    for stratum, (hits, n) in named_by_stratum(net, *val_cells).items():
        row[f"val {stratum} cells named"] = share(hits, n)
    print(row, flush=True)
    return row


def parse_variant(text: str) -> tuple[str, dict]:
    """`name:field=value,...` -> (name, VisionRecipe fields), each value cast to its field's type."""
    from tasks.vision_model import VisionRecipe

    name, _, body = text.partition(":")
    defaults = VisionRecipe()
    fields = {}
    for item in filter(None, body.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not hasattr(defaults, key):
            raise SystemExit(f"--variant {text!r}: {item!r} is not field=value of a VisionRecipe field")
        kind = type(getattr(defaults, key))
        try:
            fields[key] = kind(value)
        except ValueError:
            raise SystemExit(f"--variant {text!r}: {key} takes a {kind.__name__}, not {value!r}") from None
    return name, fields


def among_modality(logits, labels):
    """Per lesion token, the read-out's best finding among those of the lesion's modality, as a finding question's
    options are (and bench_vision_input's CNN chooses); tokens without a lesion get index 0."""
    import torch
    from benchmarks.bench_vision_input import OPTIONS
    from tasks.imaging import FINDINGS
    from tasks.vision_data import NONE

    allowed = torch.full_like(logits, float("-inf"))
    for i, label in enumerate(labels.tolist()):
        if label != NONE:
            allowed[i, OPTIONS[FINDINGS[label].modality]] = 0.0
    return (logits + allowed).argmax(-1)


def main(argv: list[str] | None = None) -> int:
    import torch
    from tqdm import tqdm
    from transformers import AutoProcessor
    from tasks.chat_format import save_processor
    from tasks.hpo import load_hpo_snapshot
    from tasks.imaging import ImagingTaskBuilder
    from tasks.model_aliases import resolve_model
    from tasks.vision_data import NONE, RenderedPool, render_pool
    from tasks.vision_model import VisionRecipe, pretrain_tower, wrap_language_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="vision_tower")
    parser.add_argument("--text-model", default="smollm2-135m-instruct")
    parser.add_argument("--val-images", type=int, default=500)
    parser.add_argument("--variant", action="append", default=[], help="NAME:field=value,... (repeatable)")
    parser.add_argument("--cells", type=int, default=0, metavar="EPOCHS",
                        help="train each tower (and a CNN) on isolated lesion cells for EPOCHS epochs instead")
    parser.add_argument("--conv-patches", action="store_true",
                        help="each variant's tower again with a convolutional patch embedding")
    args = parser.parse_args(argv)
    shipped = VisionRecipe()
    try:
        variants = [(name, fields, dataclasses.replace(shipped, **fields))
                    for name, fields in map(parse_variant, args.variant or ["shipped:"])]
    except ValueError as e:  # a recipe its own check refuses (VisionRecipe.__post_init__)
        raise SystemExit(f"--variant: {e}") from None
    torch.set_num_threads(shipped.threads)
    text_dir = resolve_model(args.text_model)
    builder = ImagingTaskBuilder(load_hpo_snapshot(), seed=0)
    most = max(max(recipe.pretrain_images for _, _, recipe in variants), READOUT_IMAGES)
    train = render_pool(builder, "train", most, shipped.threads)
    val = render_pool(builder, "val", args.val_images, shipped.threads)
    readout_pool = RenderedPool(train.images[:READOUT_IMAGES], train.lesions[:READOUT_IMAGES])
    rows = []
    if args.cells:
        from benchmarks.bench_vision_input import cells
        from tasks.imaging.world import INPUT_SIZE
        train_cells, val_cells = cells(train, INPUT_SIZE), cells(val, INPUT_SIZE)
        rows.append(on_cells("cnn (bench_vision_input)", None, 2e-3, train_cells, val_cells, args.cells))
    towers = variants
    if args.conv_patches:  # each variant again, right after it, with a convolutional patch embedding
        towers = [tower for name, fields, recipe in variants
                  for tower in ((name, fields, recipe), (f"{name}, convolutional patch embedding", fields,
                                                         dataclasses.replace(recipe, patch_embedding="conv")))]
    for name, fields, recipe in towers:
        model, tokenizer = wrap_language_model(text_dir, recipe)
        with tempfile.TemporaryDirectory() as tmp:  # the policy's processor for this variant's patch grid
            save_processor(tokenizer, Path(tmp), recipe.patch_size, recipe.merge_size)
            image_processor = AutoProcessor.from_pretrained(tmp).image_processor
        if args.cells:
            tower = cell_tower(model.model.visual, image_processor)
            rows.append(on_cells(name, tower, recipe.pretrain_lr, train_cells, val_cells, args.cells))
            continue
        pool = RenderedPool(train.images[:recipe.pretrain_images], train.lesions[:recipe.pretrain_images])
        started = time.perf_counter()
        with tqdm(total=recipe.pretrain_steps, desc=name, unit="step", mininterval=10) as progress:
            trained = pretrain_tower(model, image_processor, pool, recipe, progress)
        minutes = (time.perf_counter() - started) / 60
        visual = model.model.visual.eval()
        readout = fit_readout(*token_features(visual, image_processor, readout_pool)[:2])
        features, labels, large = token_features(visual, image_processor, val)
        logits = readout(features)
        named, among = logits.argmax(-1) == labels, among_modality(logits, labels) == labels
        lesion = labels != NONE
        row = {"variant": name, "changes": ", ".join(f"{k}={v}" for k, v in fields.items()) or "-",
               "pre-training min": round(minutes, 1),
               "lesion tokens named, last steps": round(trained["lesion_tokens_named"], 3)}
        for kind, mask in (("large", lesion & large), ("small", lesion & ~large)):
            row[f"val {kind} named"] = share(int(named[mask].sum()), int(mask.sum()))
        row["val large, among its modality's findings"] = share(int(among[lesion & large].sum()),
                                                               int((lesion & large).sum()))
        row["n large"] = int((lesion & large).sum())
        rows.append(row)
        print(row, flush=True)
    report(args.name, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the seeing policy's tower learns from pre-training alone, per recipe variant, on images it never saw.

    python benchmarks/bench_vision_tower.py [--name vision_tower] [--val-images 500] \
        [--variant NAME:field=value,field=value ...]

Each variant is the build's VisionRecipe with some fields changed (`shipped` changes none). Its random tower is
pre-trained as the build's first stage does (tasks/vision_model.pretrain_tower), then a linear read-out fitted on its
frozen tokens of 1,000 training images names the finding under each token of --val-images images rendered from a
validation split (neither the training nor the test split, so a variant is never chosen on test images): large and
small lesion tokens apart (the large also among their modality's findings alone, as a question's options are), with
95% Wilson intervals, and the minutes pre-training took.
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
    for name, fields, recipe in variants:
        model, tokenizer = wrap_language_model(text_dir, recipe)
        with tempfile.TemporaryDirectory() as tmp:  # the policy's processor for this variant's patch grid
            save_processor(tokenizer, Path(tmp), recipe.patch_size, recipe.merge_size)
            image_processor = AutoProcessor.from_pretrained(tmp).image_processor
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

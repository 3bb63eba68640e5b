"""What a seeing policy sees, and what its language model reads of it (tasks/vision_model.py).

    python benchmarks/bench_vision.py --model smollm2-135m-vision [--name vision] [--train-images 1000] [--limit 150]

Two measures on the held-out images of `imaging:finding_mcq_test` (the first --limit questions):
- the tower alone: a linear read-out fitted on the frozen tower's image tokens of --train-images rendered training
  images, then asked to name the finding under each held-out lesion token (large and small lesions apart; chance
  over the 14 findings is about 7%, over one modality's findings about 20%): how much of the finding the tokens carry;
- the policy: the build's probe, the option letter of its greedy reply (chance 25%) and the share of replies whose
  thought names the finding, with 95% Wilson intervals: how much of it the language model reads.
Prints a table and writes benchmarks/results/<name>.json.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import report  # noqa: E402
from learners.intervals import wilson_interval  # noqa: E402
from tasks.imaging import FINDINGS  # noqa: E402


def token_features(visual, image_processor, pool, batch: int = 50):
    """(features [tokens, width], finding per token, large-lesion flag per token) of every image in `pool`."""
    import torch
    from tasks.vision_data import NONE, pixels, token_targets

    features, labels, large = [], [], []
    with torch.no_grad():
        for i in range(0, len(pool.images), batch):
            values, grids = pixels(image_processor, pool.images[i:i + batch])
            features.append(visual(values, grid_thw=grids).pooler_output)
            side = int(grids[0, 1]) // visual.spatial_merge_size
            for lesions in pool.lesions[i:i + batch]:
                targets = token_targets(lesions, side, False, False)
                strata = {les["finding"]: les["stratum"] for les in lesions}
                labels += targets
                large += [t != NONE and strata.get(FINDINGS[t].key) == "large" for t in targets]
    return torch.cat(features), torch.tensor(labels), torch.tensor(large)


def fit_readout(features, labels, epochs: int = 300):
    """A linear read-out of the finding (or none) from an image token, fitted full-batch with Adam."""
    import torch
    from tasks.vision_data import NONE

    readout = torch.nn.Linear(features.shape[1], NONE + 1)
    optimizer = torch.optim.Adam(readout.parameters(), lr=1e-2)
    weight = torch.ones(NONE + 1)
    weight[NONE] = 0.2  # empty tokens outnumber lesion tokens
    for _ in range(epochs):
        loss = torch.nn.functional.cross_entropy(readout(features), labels, weight=weight)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return readout


def share(hits, n: int) -> str:
    low, high = wilson_interval(int(hits), n)
    return f"{hits / n:.3f} [{low:.3f}, {high:.3f}]"


def main(argv: list[str] | None = None) -> int:
    import torch
    from transformers import AutoProcessor
    from learners.batches import load_causal_lm
    from tasks.hpo import load_hpo_snapshot
    from tasks.imaging import ImagingTaskBuilder
    from tasks.model_aliases import resolve_model
    from tasks.vision_data import NONE, held_out_pool, render_pool
    from tasks.vision_model import probe

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a seeing policy: an alias or a Hugging Face directory")
    parser.add_argument("--name", default="vision")
    parser.add_argument("--train-images", type=int, default=1000)
    parser.add_argument("--limit", type=int, default=150)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    processor = AutoProcessor.from_pretrained(path)
    model = load_causal_lm(path, torch.float32).eval()
    train = render_pool(ImagingTaskBuilder(load_hpo_snapshot(), seed=0), "train", args.train_images, args.threads)
    held_out, questions = held_out_pool(args.limit)
    readout = fit_readout(*token_features(model.model.visual, processor.image_processor, train)[:2])
    features, labels, large = token_features(model.model.visual, processor.image_processor, held_out)
    named = readout(features).argmax(-1) == labels
    lesion = labels != NONE
    rows = [{"model": args.model, "measure": f"tower read-out: {kind} lesion tokens named",
             "value": share(int(named[mask].sum()), int(mask.sum())), "n": int(mask.sum())}
            for kind, mask in (("large", lesion & large), ("small", lesion & ~large))]
    for stratum, result in probe(model, processor, questions, held_out).items():
        for measure, key in (("answered right", "accuracy"), ("thought names the finding", "named")):
            rows.append({"model": args.model, "measure": f"policy: {stratum} lesions, {measure}",
                         "value": share(round(result[key] * result["n"]), result["n"]), "n": result["n"]})
    report(args.name, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

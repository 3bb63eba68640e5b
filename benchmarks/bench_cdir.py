"""CDIR on vs off at evaluation (Med-RwR's confidence-driven image re-retrieval, actors/cdir.py), with the tiny
random BiomedCLIP and with the tiny one trained contrastively on the imaging world's training pairs.

    python benchmarks/bench_cdir.py --checkpoint CKPT [--clip-steps 600] [--data imaging:condition_mcq_test]
        [--limit N] [--cdir-images 150] [key=value ...]

For each encoder: how often the nearest CDIR corpus case has a test image's finding against a random case of the same
modality (benchmarks/bench_clip.py's measure), then one greedy `python -m learners.evaluate --cdir` of CKPT over an
image index built with that encoder: accuracy of the first answers (CDIR off; greedy, so the same for both encoders)
and of the final ones (CDIR on), how often it fired, accuracy and mean confidence before -> after on the fired
episodes, accuracies with 95% Wilson intervals. CKPT must be a text-only policy (CDIR cannot yet re-answer a
multimodal one); key=value overrides go to the evaluation (e.g. model.tiny.arch=qwen2 for the config's tiny build).
Prints a table and writes benchmarks/results/cdir.json (with the trained encoder's training.json: seconds, held-out
InfoNCE before and after).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import report  # noqa: E402
from learners.intervals import wilson_interval  # noqa: E402

RUNS = ROOT / "outputs" / "bench_cdir"


def with_interval(mean: float | None, n: int) -> str:
    """A share of n as 'mean [low, high]' (95% Wilson), '-' when there is none."""
    if mean is None or n == 0:
        return "-"
    low, high = wilson_interval(round(mean * n), n)
    return f"{mean:.3f} [{low:.3f}, {high:.3f}]"


def evaluate_with_cdir(name: str, index_dir: Path, args) -> dict:
    """learners.evaluate --cdir over `index_dir`, in its own process (its own Ray session); its eval.json."""
    out = RUNS / name
    subprocess.run([sys.executable, "-m", "learners.evaluate", "--config", args.config, "--checkpoint",
                    args.checkpoint, "--data", args.data, "--out", str(out), "--cdir", "--image-index",
                    str(index_dir), *(["--limit", str(args.limit)] if args.limit else []), *args.overrides],
                   cwd=ROOT, check=True)
    return json.loads((out / "eval.json").read_text())


def encoder_row(name: str, clip_dir: str | None, args) -> dict:
    """The neighbour measure and CDIR off / on for one encoder (None: the tiny random one)."""
    from indexing.biomedclip import load_biomedclip
    from indexing.image_index import ensure_image_index
    from benchmarks.bench_clip import cdir_neighbour

    model = load_biomedclip(clip_dir)
    index_dir = ensure_image_index(model=model, progress=True)  # the evaluation's ImageRetriever loads its encoder
    neighbour = cdir_neighbour(model, args.cdir_images)
    result = evaluate_with_cdir(name, index_dir, args)
    cdir, n = result["cdir"], result["cdir"]["n"]
    return {"encoder": name, "model": model.identity,
            "nearest_has_finding": round(neighbour["nearest_has_finding"], 3),
            "random_same_modality": round(neighbour["random_same_modality_has_finding"], 3),
            "accuracy_off": with_interval(cdir["accuracy_before"], n),
            "accuracy_on": with_interval(cdir["accuracy_after"], n),
            "fired": f"{cdir['fired']} of {n}",
            "fired_accuracy": f"{with_interval(cdir['fired_accuracy_before'], cdir['fired'])} -> "
                              f"{with_interval(cdir['fired_accuracy_after'], cdir['fired'])}",
            "fired_confidence": "-" if not cdir["fired"] else
            f"{cdir['fired_confidence_before']:.3f} -> " + ("-" if cdir["fired_confidence_after"] is None else
                                                          f"{cdir['fired_confidence_after']:.3f}"),
            "summary": {k: v for k, v in cdir.items() if k != "episodes"}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a text-only policy (Hugging Face directory)")
    parser.add_argument("--config", default="configs/med_rwr.yaml")
    parser.add_argument("--data", default="imaging:condition_mcq_test")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--clip-steps", type=int, default=600, help="contrastive training steps of the trained encoder")
    parser.add_argument("--cdir-images", type=int, default=150, help="test images for the neighbour measure")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="dotted.key=value for the evaluation")
    args = parser.parse_args(argv)
    import torch

    from indexing.biomedclip import ensure_contrastive_biomedclip
    torch.set_num_threads(args.threads)
    encoders = {"random": None, f"contrastive_{args.clip_steps}": str(ensure_contrastive_biomedclip(args.clip_steps))}
    rows = [encoder_row(name, clip_dir, args) for name, clip_dir in encoders.items()]
    path = report("cdir", [{k: v for k, v in r.items() if k != "summary"} for r in rows])
    training = json.loads((Path(encoders[f"contrastive_{args.clip_steps}"]) / "training.json").read_text())
    path.write_text(json.dumps({**json.loads(path.read_text()), "checkpoint": args.checkpoint, "data": args.data,
                                "clip_training": {k: v for k, v in training.items() if k != "losses"},
                                "summaries": {r["encoder"]: r["summary"] for r in rows}}, indent=1))


if __name__ == "__main__":
    main()

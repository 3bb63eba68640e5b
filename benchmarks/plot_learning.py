"""bench_learning's plots, and held-out accuracy against training step for settings of its quickstart suite.

    python benchmarks/plot_learning.py long_bm25 guess_bm25 guess_bm25_sft40 --out docs/long_run.png [--grpo-from 10]

Reads the rows benchmarks/bench_learning.py --suite quickstart wrote (benchmarks/results/learning_quickstart.json):
one line per setting and split, each evaluation with its 95% (Wilson) interval, so a long GRPO run and the
imitation-only run of the same budget read side by side. bench_learning.py draws its suites' own plots with `plot`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from learners.validation import split_label  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "learning_quickstart.json"


def pyplot():
    """matplotlib's pyplot without a display; imported on use: only plotting needs it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot(rows: list[dict], suite: str, curves: dict | None = None, setting: str | None = None) -> None:
    """learning_armed[_<setting>].png: NCI curves; learning_retrieval_<setting>.png: every arm of one setting run so
    far."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    if curves:
        for name, values in curves.items():
            ax.plot(range(1, len(values) + 1), values, label=name)
        ax.set_xlabel("step"), ax.set_ylabel("NCI of the semantic reward"), ax.axhline(0.25, ls=":", c="gray")
        ax.axhline(0.1, ls="--", c="gray"), ax.legend()
    else:
        ax.bar([r["arm"] + (f" s{r['seed']}" if "seed" in r else "") for r in rows],
               [r.get("test_accuracy", r.get("accuracy")) for r in rows])
        ax.axhline(0.25, ls=":", c="gray", label="chance (4 options)")
        ax.set_ylabel("accuracy on held-out diseases"), ax.legend()
        plt.setp(ax.get_xticklabels(), rotation=15)
    fig.tight_layout()
    path = ROOT / "benchmarks" / "results" / f"learning_{suite}{f'_{setting}' if setting else ''}.png"
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def accuracy_by_step(rows: list[dict], settings: list[str], seed: int) -> dict[tuple[str, str], list[tuple]]:
    """{(setting, split): [(step, accuracy, low, high), ...] in step order} of one seed's rows."""
    out: dict[tuple[str, str], list] = {}
    for row in rows:
        if row.get("setting") in settings and row.get("seed") == seed:
            low, high = json.loads(row["ci95"])
            out.setdefault((row["setting"], row["split"]), []).append((row["step"], row["accuracy"], low, high))
    missing = [s for s in settings if not any(setting == s for setting, _ in out)]
    if missing:
        raise SystemExit(f"{RESULTS}: no rows of seed {seed} for setting(s) {', '.join(missing)}")
    return {key: sorted(points) for key, points in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("settings", nargs="+", help="quickstart-suite settings (bench_learning.py --name)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--grpo-from", type=int, help="a dotted line at the step where GRPO begins")
    args = parser.parse_args()
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    lines = accuracy_by_step(json.loads(RESULTS.read_text())["rows"], args.settings, args.seed)
    splits = list(dict.fromkeys(split for _, split in lines))
    for (setting, split), points in lines.items():  # a colour per setting, a line style per split
        steps, acc, low, high = zip(*points)
        ax.errorbar(steps, acc, yerr=[[a - lo for a, lo in zip(acc, low)], [h - a for a, h in zip(acc, high)]],
                    marker="o", capsize=3, color=f"C{args.settings.index(setting)}",
                    ls=["-", "--", ":", "-."][splits.index(split) % 4], label=f"{setting}: {split_label(split)}")
    if args.grpo_from is not None:
        ax.axvline(args.grpo_from, ls=":", c="gray", label=f"GRPO begins (step {args.grpo_from})")
    ax.set(xlabel="training step", ylabel="held-out accuracy", ylim=(0.5, 1.0))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

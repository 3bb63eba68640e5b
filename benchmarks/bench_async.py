"""Async (one_step_off) vs sync step time on the quickstart config.

    python benchmarks/bench_async.py [--steps 12] [extra dotted.key=value overrides]

Target: the one_step_off step takes <= 1.15 x max(generate, train). The first two steps (engine warm-up and
the pipeline filling) and the last (it writes a checkpoint) are left out of the means.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from benchmarks.common import report
    from learners.config import load_config
    from learners.trainer import Trainer

    rows = []
    for mode in ("sync", "one_step_off"):
        with tempfile.TemporaryDirectory() as out:
            cfg = load_config("configs/tiny.yaml", [f"async={mode}", f"total_steps={args.steps}",
                                                          f"output_dir={out}", "checkpoint.every=1000",
                                                          "rollout.fidelity_check_every=0", *args.overrides])
            history = Trainer(cfg).fit()[2:-1]  # no warm-up, no final checkpoint
        mean = {k: statistics.mean(r[k] for r in history) for k in ("step_s", "generate_s", "train_s", "sync_s")}
        rows.append({"mode": mode, **mean, "step_over_max_gen_train": mean["step_s"] / max(mean["generate_s"],
                                                                                         mean["train_s"])})
    rows.append({"mode": "speedup (sync/async step)", "step_s": rows[0]["step_s"] / rows[1]["step_s"]})
    report("async_vs_sync", rows)


if __name__ == "__main__":
    main()

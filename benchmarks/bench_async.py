"""sync vs one_step_off vs fully_async on the same run: samples/s, each mode's version-lag distribution, and the
held-out accuracy the run reaches after the same number of samples.

    python benchmarks/bench_async.py [--config configs/tiny.yaml] [--steps 12] [--modes sync one_step_off fully_async]
                                     [--name async_vs_sync] [extra dotted.key=value overrides]

The first two steps (engine warm-up, the pipeline filling) are left out of the step means and of samples/s; the
accuracy is the closing evaluation's (eval.at_end, when the config has an eval section). `cpu_busy` is the busy share
of the node's CPU time over those steps (`cpu/node_busy_fraction`), and `samples_per_s_at_full_cpu` samples/s divided
by it: what no schedule of the same work exceeds on this node, where rollouts and learner share its CPUs. Targets:
one_step_off's step <= 1.15 x max(generate, train); fully_async >= 1.3 x one_step_off's samples/s with accuracy
within noise.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WARM_UP = 2


def lag_counts(history: list[dict], groups_per_step: int) -> Counter:
    """Trained groups by how many versions their weights lagged the learner's: a step-wide lag for sync and
    one_step_off, each group's own under fully_async."""
    counts = Counter()
    for record in history:
        streamed = {int(k.rsplit("_", 1)[1]): v for k, v in record.items() if k.startswith("stream/groups_lag_")}
        counts.update(streamed or {record["version_lag"]: groups_per_step})
    return counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--modes", nargs="+", default=["sync", "one_step_off", "fully_async"])
    parser.add_argument("--name", default="async_vs_sync")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from benchmarks.common import report
    from learners.config import load_config
    from learners.trainer import Trainer

    rows = []
    for mode in args.modes:
        with tempfile.TemporaryDirectory() as out:  # checkpoints go with it
            cfg = load_config(args.config, [f"async={mode}", f"total_steps={args.steps}", f"output_dir={out}",
                                            "checkpoint.every=1000", "rollout.fidelity_check_every=0",
                                            "logging.progress_bar=false", *args.overrides])
            history = Trainer(cfg).fit()
        steady = history[WARM_UP:]
        samples = cfg.rollout.prompts_per_step * cfg.rollout.group_size
        mean = {k: statistics.mean(r[k] for r in steady) for k in ("step_s", "generate_s", "train_s", "sync_s")}
        lags = lag_counts(history, cfg.rollout.prompts_per_step)
        accuracy = {k.removeprefix("eval/").removesuffix("/accuracy"): v for k, v in history[-1].items()
                    if k.startswith("eval/") and k.endswith("/accuracy")}
        steady_s = sum(r["step_s"] for r in steady)
        samples_per_s = samples * len(steady) / steady_s
        cpu_busy = sum(r["cpu/node_busy_fraction"] * r["step_s"] for r in steady) / steady_s
        rows.append({"mode": mode, **mean, "samples_per_s": samples_per_s, "cpu_busy": cpu_busy,
                     "samples_per_s_at_full_cpu": samples_per_s / cpu_busy,
                     "step_over_max_gen_train": mean["step_s"] / max(mean["generate_s"], mean["train_s"]),
                     "env_calls_per_episode": statistics.mean(r["env_calls_per_episode"] for r in history),
                     "version_lags": " ".join(f"{lag}:{n}" for lag, n in sorted(lags.items())),
                     "stale_dropped": sum(r.get("stream/stale_dropped", 0) for r in history),
                     "partial_groups": sum(r.get("stream/partial_groups", 0) for r in history),
                     **{f"accuracy {split}": value for split, value in accuracy.items()}})
        by_mode = {r["mode"]: r for r in rows}
        if "one_step_off" in by_mode:
            for r in rows:
                r["samples_per_s_vs_one_step_off"] = r["samples_per_s"] / by_mode["one_step_off"]["samples_per_s"]
        report(args.name, rows)  # after every mode: a later one that fails loses nothing


if __name__ == "__main__":
    main()

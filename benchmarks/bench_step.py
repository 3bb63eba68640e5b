"""One GRPO step of the real model on this machine: where its time goes, and what the learner's dtype does to it.

    python benchmarks/bench_step.py [--steps 4] [model.path=CHECKPOINT ...] [--variants fp32 bf16 ...]

The quickstart's GRPO stage alone (SmolLM2-135M-Instruct, from its base weights or from model.path, e.g. the
quickstart's checkpoint after its cold start, which writes the grammar and searches; retrieval on, rewards as
shipped) at 8 prompts x 4 samples = 32 samples a step (dynamic sampling off: one generation round), once per variant:
  fp32   learner forward and backward in float32 (learner.compute_dtype=float32)
  bf16   the learner's matmuls under bfloat16 autocast; weights, gradients and Adam stay float32. Pays where the CPU
         multiplies bfloat16 natively (AVX512-BF16 or AMX; cluster.devices.fast_bfloat16), or on a GPU.
  bf16_one_rank  bf16 with one learner rank of 2 threads instead of two ranks of 1 (no gradient all-reduce between
         ranks sharing the same two cores)
  bf16_zero1  bf16 under ZeRO stage 1: gradients reduced once per optimizer step instead of after every micro-batch
  bf16_engine  bf16 with the engine sampling in bfloat16 too (rollout.dtype; the learner's weights stay float32)
  bf16_zero1_engine  both
The engine samples in float32 unless the variant says otherwise. Means over steps 2..N (step 1 warms engines and
caches); the last step also runs the fidelity check (engine vs learner log-probabilities after the sync), reported
beside the variant's tolerance; startup_s is the set-up before step 1 (Ray, actors, models loaded), by phase in the
JSON.
Target: a 32-sample step <= 60 s with sync <= 3% of it. Writes benchmarks/results/step_real.json and prints a table.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = {"fp32": ["learner.compute_dtype=float32"], "bf16": ["learner.compute_dtype=bfloat16"],
            "bf16_one_rank": ["learner.compute_dtype=bfloat16", "cluster.learner.num=1", "cluster.learner.threads=2"],
            "bf16_zero1": ["learner.compute_dtype=bfloat16", "learner.zero_stage=1"],
            "bf16_engine": ["learner.compute_dtype=bfloat16", "rollout.dtype=bfloat16"],
            "bf16_zero1_engine": ["learner.compute_dtype=bfloat16", "learner.zero_stage=1", "rollout.dtype=bfloat16"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from benchmarks.common import report
    from learners.config import load_config
    from learners.trainer import Trainer

    rows = []
    for variant in args.variants:
        with tempfile.TemporaryDirectory() as out:
            cfg = load_config("configs/quickstart.yaml", [
                f"output_dir={out}", f"total_steps={args.steps}", "eval=null", "checkpoint.every=1000",
                f"stages=[{{name: grpo, kind: grpo, steps: {args.steps}}}]", "rollout.prompts_per_step=8",
                "rollout.group_size=4", "algorithm.dynamic_sampling=false",
                f"rollout.fidelity_check_every={args.steps}",
                *VARIANTS[variant],
                *args.overrides])
            load = os.getloadavg()[0]
            history = Trainer(cfg).fit()
        timed = history[1:]
        mean = {k: statistics.mean(r[k] for r in timed) for k in ("step_s", "generate_s", "train_s", "sync_s")}
        rows.append({"variant": variant, "samples": 32, **mean, "sync_share": mean["sync_s"] / mean["step_s"],
                     "response_tokens": statistics.mean(r["response_length"] for r in timed),
                     "fidelity_max_abs_diff": history[-1].get("fidelity_max_abs_diff"),
                     "tolerance": cfg.fidelity_tolerance(), "startup_s": history[0]["startup/total_s"],
                     "startup": {k: round(v, 1) for k, v in history[0].items() if k.startswith("startup/")},
                     "load_at_start": round(load, 2),
                     "when": time.strftime("%H:%M")})
    for row in rows[1:]:  # speed-ups over the first variant
        rows.append({"variant": f"{rows[0]['variant']} / {row['variant']}", "step_s": rows[0]["step_s"] / row["step_s"],
                     "train_s": rows[0]["train_s"] / row["train_s"]})
    report("step_real", rows)


if __name__ == "__main__":
    main()

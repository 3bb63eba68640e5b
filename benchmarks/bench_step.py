"""One GRPO step of the real model on this machine: where its time and memory go, per learner setting.

    python benchmarks/bench_step.py [--steps 4] [model.path=CHECKPOINT ...] [--variants shipped zero1 ...]
                                    [--name step_real]

The quickstart's GRPO stage alone (SmolLM2-135M-Instruct, from its base weights or from model.path, e.g. the
quickstart's checkpoint after its cold start, which writes the grammar and searches; retrieval on, rewards as
shipped) at 8 prompts x 4 samples = 32 samples a step (dynamic sampling off: one generation round), once per variant:
  shipped         the quickstart's learner as configured (compute_dtype auto: bfloat16 autocast where the CPU
                  multiplies it natively, AVX512-BF16 or AMX, else float32)
  zero1           ZeRO stage 1: gradients reduced once per optimizer step instead of after every micro-batch
  released        every page a rank frees goes back to the kernel at once (learner.keep_freed_memory=false)
  checkpointing   activation checkpointing (learner.gradient_checkpointing)
  checkpointing_released  both
  zero3_checkpointing  ZeRO stage 3 (weights partitioned across the ranks too, gathered layer by layer) and
                  activation checkpointing
  tokens          micro-batches cut at 4096 tokens instead of 4 sequences (learner.max_tokens_per_micro_batch)
  engine_bf16_tis the engine samples in bfloat16 (rollout.dtype) with truncated importance sampling correcting the
                  engine-vs-learner gap (algorithm.rollout_correction.kind=tis)
  zero1_engine_bf16_tis  both
  lora            LoRA adapters (rank 16 on every linear layer of the decoder) trained instead of every weight
                  (learner.lora); the engine gets the merged weights of the layers they change
  lora_checkpointing  LoRA and activation checkpointing
The engine samples in float32 unless the variant says otherwise. Means over steps 2..N (step 1 warms engines and
caches); the last step also runs the fidelity check (engine vs learner log-probabilities after the sync), reported
beside the variant's tolerance; startup_s is the set-up before step 1 (Ray, actors, models loaded), by phase in the
JSON. Memory: the peak resident size of a learner rank, the rollout worker and the reward actor over the whole run,
sampled from /proc every 0.5 s by actor name (so code without `memory/*` metrics is measured the same way), beside
the largest per-step peak the run itself logged (`memory/learner_peak_gb`) and what a rank held between steps
(`memory/learner_resident_gb`; the object store's pages in it `memory/learner_shared_gb`, its tensors' share
`memory/learner_tensors_gb`, the process before any weights `memory/learner_process_gb`); mismatch: the
engine-vs-learner KL per token and the largest ratio (`mismatch/*`) where logged.
With --probe, the learner's tokens per second a rank (first variant) beside a plain-torch forward and backward of the
same model on one thread, the gap between them named. Targets: a 32-sample step <= 45 s with sync <= 3% of it, a
learner rank <= 3 GB. Writes
benchmarks/results/<name>.json and prints a table.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = {"shipped": [], "zero1": ["learner.zero_stage=1"],
            "released": ["learner.keep_freed_memory=false"],
            "checkpointing": ["learner.gradient_checkpointing=true"],
            "checkpointing_released": ["learner.gradient_checkpointing=true", "learner.keep_freed_memory=false"],
            "zero3_checkpointing": ["learner.zero_stage=3", "learner.gradient_checkpointing=true"],
            "tokens": ["learner.max_tokens_per_micro_batch=4096"],
            "engine_bf16_tis": ["rollout.dtype=bfloat16", "algorithm.rollout_correction.kind=tis"],
            "zero1_engine_bf16_tis": ["learner.zero_stage=1", "rollout.dtype=bfloat16",
                                      "algorithm.rollout_correction.kind=tis"],
            "lora": ["learner.lora.rank=16"],
            "lora_checkpointing": ["learner.lora.rank=16", "learner.gradient_checkpointing=true"]}
ROLES = {"learner": "ray::LearnerWorker", "rollout": "ray::RolloutWorker", "reward": "ray::RewardActor"}


class RoleMemory:
    """Peak resident GB of each role's processes (Ray names an actor's process `ray::<Class>...`), sampled."""

    def __init__(self, every_s: float = 0.5):
        self.peaks = dict.fromkeys(ROLES, 0.0)
        self.every_s, self.done = every_s, threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        import psutil
        while not self.done.wait(self.every_s):
            for proc in psutil.process_iter(["cmdline", "memory_info"]):
                title = " ".join(proc.info["cmdline"] or [])
                for role, prefix in ROLES.items():
                    if title.startswith(prefix) and proc.info["memory_info"] is not None:
                        self.peaks[role] = max(self.peaks[role], proc.info["memory_info"].rss / 1e9)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()


def plain_torch_tokens_per_s(model_path: str, tokens: int, sequences: int = 4, repeats: int = 3) -> float:
    """Tokens per second of a plain-torch forward and backward (float32, SDPA, whole logits, cross-entropy) of the
    same model on one thread, as one learner rank has: `sequences` rows of `tokens` / `sequences` random tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from tasks.model_aliases import resolve_model
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(resolve_model(model_path), dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (sequences, tokens // sequences))
    times = []
    for _ in range(repeats + 1):  # the first warms the allocator
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return ids.numel() / statistics.mean(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--name", default="step_real", help="results file benchmarks/results/<name>.json")
    parser.add_argument("--probe", action="store_true", help="also time a plain-torch forward and backward of the "
                                                              "model on a rank's thread, against the first variant")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from benchmarks.common import report
    from learners.config import load_config
    from learners.trainer import Trainer

    rows = []
    for variant in args.variants:
        with tempfile.TemporaryDirectory() as out, RoleMemory() as memory:
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
        mean = {k: statistics.mean(r[k] for r in timed) for k in ("step_s", "generate_s", "train_s", "sync_s",
                                                                  "sync_mb")}
        logged = {k: max(r[k] for r in history) for k in ("memory/learner_peak_gb", "memory/learner_resident_gb",
                                                          "memory/learner_shared_gb",
                                                          "memory/learner_tensors_gb", "memory/learner_process_gb",
                                                          "mismatch/max_ratio")
                  if k in history[0]}
        rows.append({"variant": variant, "samples": 32, **mean, "sync_share": mean["sync_s"] / mean["step_s"],
                     "response_tokens": statistics.mean(r["response_length"] for r in timed),
                     **({"learner_tokens_per_s": statistics.mean(r["learner_tokens_per_s"] for r in timed),
                         "tokens_per_sequence": statistics.mean(r["learner_tokens"] for r in timed) / 32}
                        if "learner_tokens_per_s" in history[0] else {}),
                     **{f"{role}_rss_gb": round(gb, 2) for role, gb in memory.peaks.items()},
                     **logged,
                     **({"mismatch/kl": statistics.mean(r["mismatch/kl"] for r in timed)}
                        if "mismatch/kl" in history[0] else {}),
                     "fidelity_max_abs_diff": history[-1].get("fidelity_max_abs_diff"),
                     "tolerance": cfg.fidelity_tolerance(), "startup_s": history[0]["startup/total_s"],
                     "startup": {k: round(v, 1) for k, v in history[0].items() if k.startswith("startup/")},
                     "load_at_start": round(load, 2),
                     "when": time.strftime("%H:%M")})
    if args.probe:
        per_rank = rows[0]["learner_tokens_per_s"] / cfg.cluster.learner.num
        plain = plain_torch_tokens_per_s(cfg.model.path, tokens=4 * int(rows[0]["tokens_per_sequence"]))
        rows.append({"variant": "plain torch probe (1 thread)", "learner_tokens_per_s_per_rank": per_rank,
                     "plain_tokens_per_s": plain, "learner / plain": per_rank / plain})
    for row in rows[1:len(args.variants)]:  # speed-ups over the first variant
        rows.append({"variant": f"{rows[0]['variant']} / {row['variant']}", "step_s": rows[0]["step_s"] / row["step_s"],
                     "train_s": rows[0]["train_s"] / row["train_s"]})
    report(args.name, rows)


if __name__ == "__main__":
    main()

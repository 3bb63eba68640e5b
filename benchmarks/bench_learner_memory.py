"""A learner rank's memory over many steps of new micro-batch lengths: the real model's learner group alone.

    python benchmarks/bench_learner_memory.py [--steps 6] [--entries 64 0] [--name learner_memory]

The quickstart's learner (two DeepSpeed ranks, SmolLM2-135M-Instruct, bfloat16 autocast where the CPU multiplies
it natively) trains GRPO steps of 32 synthetic sequences whose prompt (230-300 tokens) and response (60-400) lengths
are drawn anew each step, the same draws for every arm, and publishes its weights after each step as a sync does. One
arm per `learner.kernel_cache_entries` value (0: oneDNN's and ideep's default, 1,024 each). Per step: the largest
rank's peak (`memory/learner_peak_gb`), what a rank held as the step began (`memory/learner_resident_gb`), jemalloc's
live bytes in rank 1 after the step (the ranks' heap without freed pages; rank 0 also holds the sync's pack
buffers), and the step's training seconds. Writes benchmarks/results/<name>.json and prints a table.
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def batch(rng: random.Random, step: int) -> list:
    """32 trajectories of 4 groups with fresh lengths; random token ids (the learner's memory does not read them)."""
    from actors.trajectory import Trajectory
    trajs = []
    for i in range(32):
        prompt, response = rng.randint(230, 300), rng.randint(60, 400)
        trajs.append(Trajectory(task={}, group=i // 8, prompt_ids=[rng.randrange(1000, 40000) for _ in range(prompt)],
                                response_ids=[rng.randrange(1000, 40000) for _ in range(response)],
                                logprobs=[-1.0] * response, loss_mask=[1] * response, text="", finish_reason="stop",
                                weight_version=step))
    return trajs


def live_gb(worker) -> float:
    """jemalloc's allocated bytes (live, not freed pages) in the process of a learner rank, in GB."""
    import ray

    from cluster.devices import allocated_gb
    return ray.get(worker.__ray_call__.remote(lambda _: allocated_gb()))


def arm(entries: int, steps: int) -> list[dict]:
    import ray

    from cluster.placement import place
    from cluster.ray_session import start_or_join
    from learners.config import load_config
    from learners.learner_group import LearnerGroup
    from tasks.model_aliases import resolve_model

    cfg = load_config("configs/quickstart.yaml", ["output_dir=unused", "rollout.group_size=8",
                                                  f"learner.kernel_cache_entries={entries}"])
    start_or_join(cfg.cluster)
    placement = place(cfg.cluster)
    group = LearnerGroup(cfg, placement, str(resolve_model(cfg.model.path)))
    rng, rows = random.Random(0), []
    try:
        for step in range(1, steps + 1):
            trajs = batch(rng, step)
            done = group.train([ray.put(trajs)], [rng.choice([-1.0, 1.0]) for _ in trajs], cfg)
            group.publish(step)
            rows.append({"kernel_cache_entries": entries or "default", "step": step,
                         "tokens": done.reports["learner_tokens"], "train_s": round(done.seconds, 1),
                         "peak_gb": round(done.reports["memory/learner_peak_gb"], 2),
                         "resident_gb": round(done.reports["memory/learner_resident_gb"], 2),
                         "rank1_live_gb": round(live_gb(group.ranks[1]), 2)})
            print(rows[-1], flush=True)
    finally:
        group.shutdown()
        placement.remove()
        ray.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--entries", type=int, nargs="+", default=[64, 0])
    parser.add_argument("--name", default="learner_memory")
    args = parser.parse_args()
    from benchmarks.common import report
    report(args.name, [row for entries in args.entries for row in arm(entries, args.steps)])


if __name__ == "__main__":
    main()

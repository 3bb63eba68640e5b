"""What rewards cost: their share of a training step, and the throughput of the model-based scorers.

    python benchmarks/bench_rewards.py [--metrics PATH/metrics.jsonl] [--steps 5] [--sizes 8 32 128]
                                       [--pairs 256] [--threads 1] [--clip-dir DIR] [--judge-max-tokens 64]
                                       [run overrides ...]

1. Reward share of a step (target < 20%): the mean of reward_s / step_s over a quickstart-size run's metrics.jsonl,
   either given with --metrics or made by running `learners/run.py --config configs/tiny.yaml
   total_steps=<steps> output_dir=/tmp/bench_rw_<pid>` (extra dotted overrides are passed on, e.g. a different
   rewards list). The first step (engine warm-up) and, with 3+ steps, the last (it writes a checkpoint) are left out.
2. Batched BERTScore F1 and CosSim (rewards/semantic.py, the offline all-MiniLM-L6-v2) in pairs/s at a few batch
   sizes, on HPO definitions paired with each other, with `--threads` torch threads (a reward actor has 1).
3. BiomedCLIP image and text embedding (indexing/biomedclip.py) in items/s at the same batch sizes: the tiny
   random model unless --clip-dir names real weights.
4. One `judge_answer` pass over a quickstart-size batch (16 x 8) through a JudgeActor on the tiny vLLM model (its
   outputs are garbage, so every judgement takes all its retries: an upper bound for that model).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_quickstart(steps: int, overrides: list[str]) -> Path:
    """Train the quickstart config for `steps` steps in a fresh /tmp directory; returns its metrics.jsonl."""
    out = Path(f"/tmp/bench_rw_{os.getpid()}_{int(time.time())}")
    cmd = [sys.executable, "learners/run.py", "--config", "configs/tiny.yaml", f"total_steps={steps}",
           f"output_dir={out}", "logging.progress_bar=false", *overrides]
    print("running:", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    return out / "metrics.jsonl"


def step_share_row(metrics: Path) -> dict:
    """Mean seconds per phase and the reward share, reward_s / step_s, over the steady-state steps of a run."""
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{metrics}: no steps recorded")
    steady = records[1:-1] if len(records) >= 3 else records[1:] or records
    mean = {k: statistics.mean(r[k] for r in steady) for k in ("reward_s", "generate_s", "train_s", "step_s")}
    return {"measure": "reward share of a step", "steps": f"{steady[0]['step']}-{steady[-1]['step']}", **mean,
            "share": statistics.mean(r["reward_s"] / r["step_s"] for r in steady), "target": "< 0.2",
            "rewards": ",".join(k.removeprefix("reward/") for k in records[0] if k.startswith("reward/"))}


def per_second(fn, items: int, repeats: int = 2) -> float:
    """Items per second of fn() (which handles `items` items), the best of `repeats` runs after one warm-up."""
    fn()
    best = min(_timed(fn) for _ in range(repeats))
    return items / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def definition_pairs(n: int) -> tuple[list[str], list[str]]:
    """n (hypothesis, reference) pairs of distinct HPO term definitions: realistic lengths of medical text."""
    from tasks.hpo import load_hpo_snapshot
    texts = sorted({t.definition for t in load_hpo_snapshot().terms.values() if len(t.definition.split()) >= 8})
    return texts[:n], texts[n:2 * n]


def similarity_rows(sizes: list[int], pairs: int) -> list[dict]:
    from rewards.semantic import load_bertscore, load_encoder
    hyps, refs = definition_pairs(pairs)
    rows = []
    for size in sizes:
        bert, cos = load_bertscore(batch_size=size), load_encoder(None, size)
        rows.append({"measure": "BERTScore F1 (MiniLM)", "batch": size,
                     "per_s": per_second(lambda: bert.f1(hyps, refs), pairs), "unit": "pairs/s"})
        rows.append({"measure": "CosSim (MiniLM)", "batch": size,
                     "per_s": per_second(lambda: cos.cosine(hyps, refs), pairs), "unit": "pairs/s"})
    return rows


def clip_rows(sizes: list[int], items: int, clip_dir: str | None) -> list[dict]:
    import numpy as np
    from PIL import Image

    from indexing.biomedclip import load_biomedclip
    clip = load_biomedclip(clip_dir)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)) for _ in range(items)]
    texts, _ = definition_pairs(items)
    which = "tiny random" if clip_dir is None else Path(clip_dir).name
    rows = []
    for size in sizes:
        clip.batch_size = size
        rows.append({"measure": f"BiomedCLIP images ({which})", "batch": size,
                     "per_s": per_second(lambda: clip.embed_images(images), items), "unit": "images/s"})
        rows.append({"measure": f"BiomedCLIP texts ({which})", "batch": size,
                     "per_s": per_second(lambda: clip.embed_texts(texts), items), "unit": "texts/s"})
    return rows


def judge_row(prompts: int, group_size: int, max_tokens: int) -> dict:
    """Seconds of one `judge_answer` pass over a quickstart-size batch (prompts x group_size HPO questions, answers
    drawn among the option letters) with the tiny vLLM judge, in a local Ray; with its judge counters."""
    import random

    import ray

    from actors.judge import JudgeActor
    from actors.trajectory import Trajectory
    from cluster.ray_session import start_or_join
    from cluster.config import ClusterConfig
    from learners.data import load_tasks
    from rewards.judge import JudgeAnswer

    rng = random.Random(0)
    tasks = load_tasks("hpo:mcq_train")[:prompts]
    batch = [Trajectory(task=t, group=g, prompt_ids=[], response_ids=[], logprobs=[], loss_mask=[],
                        text=f"<answer>{rng.choice('ABCD')}</answer>", finish_reason="stop", weight_version=0)
             for g, t in enumerate(tasks) for _ in range(group_size)]
    start_or_join(ClusterConfig(num_cpus=2))
    try:
        judge = JudgeActor.options(name="JudgeActor", num_cpus=1).remote({"max_tokens": max_tokens})
        ray.get(judge.stats.remote())
        reward = JudgeAnswer()
        reward(batch[:group_size])  # warm-up
        seconds = _timed(lambda: reward(batch))
        stats = ray.get(judge.stats.remote())
    finally:
        ray.shutdown()
    return {"measure": f"judge_answer, tiny vLLM judge, max_tokens {max_tokens}", "batch": len(batch),
            "seconds": seconds, "per_s": len(batch) / seconds, "unit": "samples/s",
            "judge": {k: stats[k] for k in ("prompts", "generations", "parse_failures")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--metrics", help="an existing run's metrics.jsonl (default: run the quickstart)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--pairs", type=int, default=256, help="pairs (texts, images) per throughput measurement")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the throughput measurements")
    parser.add_argument("--clip-dir", help="a local BiomedCLIP open_clip directory (default: the tiny model)")
    parser.add_argument("--judge-max-tokens", type=int, default=64,
                        help="new tokens per judgement in the judge row (0: no judge row)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value for the quickstart run")
    args = parser.parse_args()

    from benchmarks.common import report
    metrics = Path(args.metrics) if args.metrics else run_quickstart(args.steps, args.overrides)
    rows = [step_share_row(metrics)]

    import torch
    torch.set_num_threads(args.threads)
    rows += similarity_rows(args.sizes, args.pairs)
    if (ROOT / "actors" / "biomedclip.py").exists():
        rows += clip_rows(args.sizes, args.pairs, args.clip_dir)
    else:
        print("indexing/biomedclip.py is not there: no CLIP throughput")
    for row in rows[1:]:
        row["threads"] = args.threads
    if args.judge_max_tokens:
        rows.append(judge_row(16, 8, args.judge_max_tokens))
    report("rewards", rows)


if __name__ == "__main__":
    main()

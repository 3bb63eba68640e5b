"""Score a checkpoint on a task split through rollout workers.

    python -m learners.evaluate --config configs/quickstart.yaml --checkpoint outputs/quickstart/checkpoints/latest \
        --data hpo:mcq_test [--limit 200] [--out DIR] [dotted.key=value ...]

The config supplies the grammar (retrieval, turn limits), resources and sampling length; decoding is greedy.
Multiple choice: accuracy with a 95% Wilson interval. Open-ended: BLEU-1, ROUGE-1, BERTScore and CosSim, each with a
95% normal interval. Both: format rate, response length, environment calls and errors per sample. Writes
`eval.json` and `eval.md` into --out (default: <checkpoint>/eval).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learners.config import load_config  # noqa: E402


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (better than the normal one near 0 and 1)."""
    if n == 0:
        return 0.0, 0.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def mean_interval(values: list[float], z: float = 1.96) -> dict:
    arr = np.asarray(values, dtype=float)
    half = z * arr.std(ddof=1) / math.sqrt(len(arr)) if len(arr) > 1 else 0.0
    return {"mean": float(arr.mean()), "low": float(arr.mean() - half), "high": float(arr.mean() + half)}


def score(trajectories: list, summaries: list[dict]) -> dict:
    """Metrics of greedy episodes, one per task."""
    from rewards.builtin import answer_correct, extract_answer
    from rewards.text_similarity import bleu1, rouge1, score_against_gold

    n = len(trajectories)
    metrics = {"n": n,
               "format_rate": mean_interval([extract_answer(t.text) is not None for t in trajectories]),
               "response_length": float(np.mean([len(t.response_ids) for t in trajectories])),
               "env_calls_per_sample": sum(s["env_calls"] for s in summaries) / n,
               "env_errors": sum(s["env_errors"] for s in summaries)}
    mcq = [t for t in trajectories if t.task.get("options")]
    if mcq:
        correct = sum(answer_correct(t) for t in mcq)
        low, high = wilson_interval(correct, len(mcq))
        metrics["accuracy"] = {"mean": correct / len(mcq), "low": low, "high": high, "n": len(mcq)}
    open_ended = [t for t in trajectories if not t.task.get("options")]
    if open_ended:
        from rewards.semantic import load_bertscore, load_encoder
        pairwise = {"bleu1": lambda a, g: [bleu1(x, y) for x, y in zip(a, g)],
                    "rouge1": lambda a, g: [rouge1(x, y) for x, y in zip(a, g)],
                    "bertscore": load_bertscore().f1, "cos_sim": load_encoder().cosine}
        for name, fn in pairwise.items():
            metrics[name] = {**mean_interval(score_against_gold(open_ended, fn)), "n": len(open_ended)}
    return metrics


def markdown(metrics: dict, title: str) -> str:
    rows = ["| metric | value | 95% interval |", "|---|---|---|"]
    for name, value in metrics.items():
        if isinstance(value, dict):
            rows.append(f"| {name} | {value['mean']:.4f} | [{value['low']:.4f}, {value['high']:.4f}] |")
        else:
            rows.append(f"| {name} | {value:.4g} | |" if isinstance(value, float) else f"| {name} | {value} | |")
    return f"## {title}\n\n" + "\n".join(rows) + "\n"


def evaluate(cfg, checkpoint: str, data: str, limit: int | None, batch_size: int = 64) -> dict:
    """Greedy episodes for every task of `data` on rollout workers loaded from `checkpoint`, then their metrics."""
    import ray
    from tqdm import tqdm

    from actors.rollout_worker import RolloutWorker
    from cluster.placement import place
    from cluster.ray_session import start_or_join
    from learners.data import load_tasks

    start_or_join(cfg.cluster)
    tasks = load_tasks(data)[:limit]
    placement = place(cfg.cluster, roles=("rollout",))
    workers = [RolloutWorker.options(**placement.options("rollout", i, f"EvalRolloutWorker-{i}")).remote(
        checkpoint, seed=cfg.seed, threads=cfg.cluster.rollout.threads, dtype=cfg.model.dtype,
        max_model_len=cfg.rollout.max_model_len, kv_cache_gb=cfg.rollout.kv_cache_gb,
        grammar=cfg.rollout.grammar.model_dump()) for i in range(cfg.cluster.rollout.num)]
    sampling = {"temperature": 0.0, "max_tokens": cfg.rollout.max_new_tokens, "stop": cfg.rollout.stop}
    trajectories, summaries = [], []
    try:
        with tqdm(total=len(tasks), desc="evaluate", unit="task") as bar:
            for start in range(0, len(tasks), batch_size * len(workers)):
                batch = tasks[start:start + batch_size * len(workers)]
                chunks = np.array_split(np.arange(len(batch)), len(workers))
                refs = [w.rollout.options(num_returns=2).remote([batch[i] for i in c], c.tolist(), 1, sampling,
                                                                cfg.seed)
                        for w, c in zip(workers, chunks) if len(c)]
                for traj_ref, summary_ref in refs:
                    trajectories += ray.get(traj_ref)
                    summaries.append(ray.get(summary_ref))
                bar.update(len(batch))
    finally:
        for w in workers:
            ray.kill(w)
        placement.remove()
    return score(trajectories, summaries)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--checkpoint", required=True, help="a Hugging Face model directory")
    parser.add_argument("--data", required=True, help="JSONL of task records or hpo:<split>")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    metrics = evaluate(cfg, args.checkpoint, args.data, args.limit)
    out = Path(args.out or Path(args.checkpoint).resolve() / "eval")
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps({"checkpoint": args.checkpoint, "data": args.data, **metrics}, indent=1))
    (out / "eval.md").write_text(markdown(metrics, f"{args.checkpoint} on {args.data}"))
    print(markdown(metrics, f"{args.checkpoint} on {args.data}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

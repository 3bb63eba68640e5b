"""Engine vs learner log-probabilities on the same weights: the floor `rollout.fidelity_tolerance` must sit above.

    python benchmarks/bench_fidelity.py [--model DIR] [--synced-from DIR] [--dtypes float32 bfloat16] [--sequences 8]

For each dtype, a fresh RolloutWorker (vLLM) on --model and the learner's forward (the HF module, as
`LearnerWorker.sequence_logprobs` runs it) score the same sequences: the engine's own samples on held-out HPO prompts.
With --synced-from, a second engine starts on that checkpoint and receives --model's weights through the object-store
sync (WeightPublisher -> update_weights); its log-probabilities must equal the fresh engine's, so that what remains
between engine and learner is kernel rounding, not the sync. Without --model: the tiny default model.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import ray  # noqa: E402


def learner_logprobs(model_path: str, dtype: str, sequences: list[list[int]]) -> list[np.ndarray]:
    import torch

    from learners.algorithm import token_logprobs
    from learners.batches import load_causal_lm
    model = load_causal_lm(model_path, getattr(torch, dtype)).eval()
    with torch.no_grad():
        return [token_logprobs(model(input_ids=ids).logits[:, :-1], ids[:, 1:]).squeeze(0).numpy()
                for ids in (torch.tensor([s]) for s in sequences)]


def engine_logprobs(worker, sequences: list[list[int]]) -> list[np.ndarray]:
    return [np.array(lp) for lp in ray.get(worker.prompt_logprobs.remote(sequences))]


def max_abs_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return float(max(np.max(np.abs(x - y)) for x, y in zip(a, b)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="HF model directory (default: the tiny model)")
    parser.add_argument("--synced-from", help="a checkpoint of the same architecture to sync --model's weights onto")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--sequences", type=int, default=8)
    args = parser.parse_args()

    import torch

    from actors.rollout_worker import RolloutWorker
    from benchmarks.common import MODEL_TINY, report
    from cluster.ray_session import start_or_join
    from cluster.weight_sync import WeightPublisher
    from cluster.config import ClusterConfig
    from learners.data import load_tasks
    from learners.batches import load_causal_lm
    from tasks.tiny_models import ensure_tiny_model

    start_or_join(ClusterConfig())
    model = args.model or str(ensure_tiny_model(MODEL_TINY))
    tasks = load_tasks("hpo:mcq_test")[:args.sequences]
    rows = []
    for dtype in args.dtypes:
        worker = RolloutWorker.options(num_cpus=0).remote(model, seed=0, threads=2, dtype=dtype)
        prompts = [ray.get(worker.chat_prompt_ids.remote(t["messages"])) for t in tasks]
        outs = ray.get(worker.generate.remote(prompts, {"max_tokens": 96, "temperature": 1.0},
                                              list(range(len(prompts)))))
        sequences = [p + o["ids"] for p, o in zip(prompts, outs)]
        engine, learner = engine_logprobs(worker, sequences), learner_logprobs(model, dtype, sequences)
        ray.kill(worker)
        diffs, logprobs = np.concatenate([np.abs(e - h) for e, h in zip(engine, learner)]), np.concatenate(learner)
        row = {"dtype": dtype, "tokens": len(diffs), "max_abs_diff": float(diffs.max()),
               "mean_abs_diff": float(diffs.mean()),
               "max_abs_diff_logprob_above_-5": float(diffs[logprobs > -5].max(initial=0.0)),
               "min_logprob": float(logprobs.min())}
        if args.synced_from:
            synced = RolloutWorker.options(num_cpus=0).remote(args.synced_from, seed=0, threads=2, dtype=dtype)
            weights = list(load_causal_lm(model, getattr(torch, dtype)).named_parameters())
            ray.get(synced.update_weights.remote(WeightPublisher().publish(iter(weights), 1)))
            row["synced_vs_fresh_engine_max_abs_diff"] = max_abs_diff(engine_logprobs(synced, sequences), engine)
            ray.kill(synced)
        rows.append(row)
    report("fidelity", rows)


if __name__ == "__main__":
    main()

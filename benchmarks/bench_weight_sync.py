"""Weight sync: learner -> rollout workers through the Ray object store.

    python benchmarks/bench_weight_sync.py [--receivers 2] [--metrics outputs/quickstart/metrics.jsonl]

1. Transport: 1M..100M fp32 parameters published once and read by every receiver (median of 3 rounds).
2. Into live vLLM engines: the tiny and ~50M models, publish + `update_weights` on a RolloutWorker.
3. Its share of a quickstart step, from a run's metrics.jsonl (target < 5%).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402


@ray.remote
class Publisher:
    """Stands in for learner rank 0: the same WeightPublisher over a model's named parameters."""

    def __init__(self, num_params: int = 0, model_path: str | None = None, layers: int = 12):
        import torch

        from cluster.weight_sync import WeightPublisher
        if model_path:
            from safetensors.torch import load_file
            self.weights = list(load_file(f"{model_path}/model.safetensors").items())
        else:
            per = num_params // layers
            self.weights = [(f"layers.{i}.weight", torch.randn(per)) for i in range(layers)]
        self.publisher = WeightPublisher()

    def publish(self, version: int):
        return self.publisher.publish(iter(self.weights), version)

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.weights)


@ray.remote
class Receiver:
    def receive(self, manifest) -> float:
        from cluster.weight_sync import receive_weights
        return float(sum(t.float().sum() for _, t in receive_weights(manifest)))  # touch every byte


def sync_round(publisher, receivers, version: int, load) -> float:
    start = time.perf_counter()
    manifest = ray.get(publisher.publish.remote(version))
    ray.get([load(r, manifest) for r in receivers])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--receivers", type=int, default=2)
    parser.add_argument("--metrics", default="outputs/quickstart/metrics.jsonl")
    args = parser.parse_args()

    from actors.rollout_worker import RolloutWorker
    from benchmarks.common import MODEL_50M, MODEL_TINY, report
    from cluster.ray_session import start_or_join
    from cluster.config import ClusterConfig
    from tasks.tiny_models import ensure_tiny_model

    start_or_join(ClusterConfig())
    rows = []
    receivers = [Receiver.options(num_cpus=0).remote() for _ in range(args.receivers)]
    for millions in (1, 10, 50, 100):
        pub = Publisher.options(num_cpus=0).remote(num_params=millions * 10**6)
        times = [sync_round(pub, receivers, v, lambda r, m: r.receive.remote(m)) for v in range(3)]
        nbytes = ray.get(pub.num_bytes.remote())
        rows.append({"path": "object store -> readers", "params_M": millions, "receivers": args.receivers,
                     "seconds": statistics.median(times), "GB_per_s": nbytes / statistics.median(times) / 1e9})
        ray.kill(pub)
    for label, cfg in (("tiny", MODEL_TINY), ("50M", MODEL_50M)):
        path = str(ensure_tiny_model(cfg))
        pub = Publisher.options(num_cpus=0).remote(model_path=path)
        worker = RolloutWorker.options(num_cpus=0).remote(path, seed=0, threads=2)
        ray.get(worker.ready.remote())
        times = [sync_round(pub, [worker], v, lambda r, m: r.update_weights.remote(m)) for v in range(1, 4)]
        nbytes = ray.get(pub.num_bytes.remote())
        rows.append({"path": "into live vLLM engine", "params_M": round(nbytes / 4e6, 1), "receivers": 1,
                     "seconds": statistics.median(times), "GB_per_s": nbytes / statistics.median(times) / 1e9})
        ray.kill(worker)
        ray.kill(pub)
    metrics = Path(args.metrics)
    if metrics.exists():
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        sync = statistics.mean(r["sync_s"] for r in records)
        step = statistics.mean(r["step_s"] for r in records)
        rows.append({"path": f"quickstart step share ({metrics})", "seconds": sync, "step_s": step,
                     "share": sync / step})
    report("weight_sync", rows)


if __name__ == "__main__":
    main()

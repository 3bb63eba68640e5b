"""How long a multi-turn rollout's engine sits idle waiting on its environment (target < 10%), and the tool latency
share of an episode.

    python benchmarks/bench_env_idle.py [--episodes 64]

A real RolloutWorker (tiny models) is constrained (structured output) to act every turn, so every episode calls its
environment `max_turns` times: a Retriever actor over the HPO knowledge base (BM25), and a zoom-in ToolActor on the
synthetic images with the tiny Qwen2.5-VL. Idle = time the engine had no request left to decode while environment
calls were outstanding (EpisodeRunner's `idle_s`), as a share of the rollout's wall time.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import report  # noqa: E402

QUERY = r"<query>[a-z ]{8,40}</query>"
ZOOM = (r'<tool_call>\{"name": "zoom_in", "arguments": \{"box": \[[1-9][0-9], [1-9][0-9], 1[0-9][0-9], '
        r'1[0-9][0-9]\]\}\}</tool_call>')


def measure(name: str, model: str, environment, grammar: dict, tasks: list[dict], regex: str) -> dict:
    import ray
    from vllm.sampling_params import StructuredOutputsParams

    from actors.rollout_worker import RolloutWorker
    worker = RolloutWorker.options(num_cpus=0).remote(model, seed=0, threads=2, max_model_len=1536, kv_cache_gb=0.5,
                                                      grammar=grammar, environment=environment)
    sampling = {"temperature": 1.0, "max_tokens": 128, "structured_outputs": StructuredOutputsParams(regex=regex)}
    try:
        ray.get(worker.rollout.remote(tasks[:2], [0, 1], 1, sampling, 1, grammar))  # warm-up
        _, summary = ray.get(worker.rollout.remote(tasks, list(range(len(tasks))), 1, sampling, 0, grammar))
    finally:
        ray.kill(worker)
    return {"environment": name, "episodes": len(tasks), "env_calls": summary.env_calls,
            "env_errors": summary.env_errors, "rollout_s": round(summary.seconds, 2),
            "idle_s": round(summary.idle_s, 5), "idle_share": round(summary.idle_s / summary.seconds, 5)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=64)
    args = parser.parse_args()
    os.environ.pop("RAY_ADDRESS", None)
    import ray

    from indexing.build_index import ensure_index
    from actors.retrieval_env import RetrievalEnvironment
    from actors.gym import ToolsConfig, make_tool_environment
    from indexing.retrieval_index import IndexConfig
    from actors.retriever import Retriever
    from indexing.build_index import default_index_dir
    from cluster.ray_session import start_or_join
    from cluster.config import ClusterConfig
    from tasks.tiny_models import TinyModelConfig
    from learners.data import load_tasks
    from tasks.tiny_models import ensure_tiny_model

    start_or_join(ClusterConfig(num_cpus=2))
    rows = []
    try:
        index = default_index_dir("hpo", "none", 1)
        ensure_index("hpo", index, config=IndexConfig(kind="none"))
        retriever = Retriever.options(num_cpus=0).remote(str(index), config={"mode": "sparse"})
        grammar = {"action_tag": "query", "observation_tag": "retrieve", "max_turns": 2, "max_response_tokens": 512,
                   "max_observation_tokens": 128}
        rows.append(measure("retriever (HPO KB, BM25)", str(ensure_tiny_model(TinyModelConfig())),
                            RetrievalEnvironment(retriever, 3), grammar, load_tasks("hpo:mcq_train")[:args.episodes],
                            QUERY))
        tools = make_tool_environment(ToolsConfig(tools={"zoom_in": {"num_cpus": 0}}))
        grammar = {"action_tag": "tool_call", "observation_tag": "tool_response", "max_turns": 2,
                   "max_response_tokens": 512, "max_observation_tokens": 128}
        rows.append(measure("zoom_in tool (Qwen2.5-VL tiny)", str(ensure_tiny_model(TinyModelConfig(arch="qwen2_5_vl"))),
                            tools, grammar, load_tasks("imaging:finding_mcq_train")[:args.episodes], ZOOM))
    finally:
        ray.shutdown()
    report("env_idle", rows)


if __name__ == "__main__":
    main()

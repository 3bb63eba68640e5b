"""Rollout throughput: the vLLM RolloutWorker actor vs Hugging Face `generate`, same model and workload.

    python benchmarks/bench_rollout.py [--threads 2]

Both sample every completion to its full length (EOS ignored): the tiny model with 16 prompts x 8 samples x 32
tokens, the ~50M model with 8 prompts x 4 samples x 256 tokens. Target: >= 3x at ~50M, never slower at tiny size.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def hf_generate(model_path: str, prompts: list[list[int]], group: int, new_tokens: int, threads: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    pad = model.config.pad_token_id
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts for _ in range(group)])
    attention = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts
                                                            for _ in range(group)])[:, None]).long()
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=attention, do_sample=True, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, pad_token_id=pad)
    return time.perf_counter() - start


def vllm_generate(model_path: str, prompts: list[list[int]], group: int, new_tokens: int, threads: int) -> float:
    import ray
    from actors.rollout_worker import RolloutWorker
    worker = RolloutWorker.options(num_cpus=1).remote(model_path, seed=0, threads=threads, max_model_len=1024)
    ray.get(worker.ready.remote())
    flat = [p for p in prompts for _ in range(group)]
    sampling = {"temperature": 1.0, "max_tokens": new_tokens, "min_tokens": new_tokens, "ignore_eos": True}
    ray.get(worker.generate.remote(flat[:2], sampling, [0, 1]))  # warm-up
    start = time.perf_counter()
    ray.get(worker.generate.remote(flat, sampling, list(range(len(flat)))))
    seconds = time.perf_counter() - start
    ray.kill(worker)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from benchmarks.common import MODEL_50M, MODEL_TINY, report
    from cluster.ray_session import start_or_join
    from cluster.config import ClusterConfig
    from learners.data import load_tasks
    from tasks.tiny_models import ensure_tiny_model

    start_or_join(ClusterConfig())
    tasks = load_tasks("hpo:mcq_train")
    rows = []
    for label, cfg, n_prompts, group, new_tokens in (("tiny", MODEL_TINY, 16, 8, 32), ("50M", MODEL_50M, 8, 4, 256)):
        path = str(ensure_tiny_model(cfg))
        tok = AutoTokenizer.from_pretrained(path)
        prompts = [tok.apply_chat_template(t["messages"], add_generation_prompt=True, tokenize=True,
                                           return_dict=False) for t in tasks[:n_prompts]]
        n_tokens = n_prompts * group * new_tokens
        vllm_s = vllm_generate(path, prompts, group, new_tokens, args.threads)
        hf_s = hf_generate(path, prompts, group, new_tokens, args.threads)
        rows.append({"model": label, "params_M": round(_params(path) / 1e6, 2), "samples": n_prompts * group,
                     "new_tokens": new_tokens, "hf_tok_s": n_tokens / hf_s, "vllm_tok_s": n_tokens / vllm_s,
                     "speedup": hf_s / vllm_s})
        print(rows[-1], flush=True)
    report("rollout_throughput", rows)


def _params(path: str) -> int:
    import math
    from safetensors import safe_open
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


if __name__ == "__main__":
    main()

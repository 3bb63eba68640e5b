"""Multimodal rollout throughput: the vLLM RolloutWorker vs Hugging Face `generate`, on the tiny Qwen2.5-VL.

    python benchmarks/bench_multimodal.py [--threads 2] [--prompts 8] [--group 4] [--new-tokens 32]

The workload is the synthetic imaging world's finding questions (one 448-px image each, 16 image tokens at the
model's input size): `prompts` tasks x `group` samples, every sample written to its full length (EOS ignored). The
RolloutWorker runs its whole path (image loading, processor, episodes, trajectories with images); HF runs the model's
processor and one batched `generate` (left padding). images/s counts sampled episodes per second (each looks at one
image), tokens/s the new tokens. Results: benchmarks/results/multimodal.json.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def hf_generate(model_path: str, tasks: list[dict], group: int, new_tokens: int, threads: int) -> float:
    """Seconds for one batched sampling `generate` over every (task, sample), images through the processor."""
    import torch
    from PIL import Image
    from transformers import AutoProcessor

    from learners.batches import load_causal_lm
    from tasks.schema import chat_prompt_ids
    torch.set_num_threads(threads)
    processor = AutoProcessor.from_pretrained(model_path)
    processor.tokenizer.padding_side = "left"
    model = load_causal_lm(model_path, torch.float32).eval()
    texts, images = [], []
    for t in tasks:
        ids = chat_prompt_ids(processor.tokenizer, t["messages"], len(t["images"]))
        texts += [processor.tokenizer.decode(ids)] * group
        images += [Image.open(t["images"][0]).convert("RGB")] * group
    start = time.perf_counter()
    inputs = processor(text=texts, images=images, padding=True, return_tensors="pt")
    with torch.no_grad():
        model.generate(**inputs, do_sample=True, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       pad_token_id=processor.tokenizer.pad_token_id)
    return time.perf_counter() - start


def vllm_rollout(model_path: str, tasks: list[dict], group: int, new_tokens: int, threads: int) -> float:
    """Seconds for `RolloutWorker.rollout` on the same tasks (after a warm-up on one of them)."""
    import ray

    from actors.rollout_worker import RolloutWorker
    worker = RolloutWorker.options(num_cpus=1).remote(model_path, seed=0, threads=threads, max_model_len=1024)
    ray.get(worker.ready.remote())
    sampling = {"temperature": 1.0, "max_tokens": new_tokens, "min_tokens": new_tokens, "ignore_eos": True}
    ray.get(worker.rollout.remote(tasks[:1], [0], 1, sampling, seed=1))  # warm-up
    start = time.perf_counter()
    trajectories, _ = ray.get(worker.rollout.remote(tasks, list(range(len(tasks))), group, sampling, seed=0))
    seconds = time.perf_counter() - start
    assert all(len(t.response_ids) == new_tokens and t.images for t in trajectories)
    ray.kill(worker)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()

    import ray

    from benchmarks.common import report
    from cluster.ray_session import start_or_join
    from cluster.config import ClusterConfig
    from tasks.tiny_models import TinyModelConfig
    from learners.data import load_tasks
    from tasks.tiny_models import ensure_tiny_model

    start_or_join(ClusterConfig())
    try:
        path = str(ensure_tiny_model(TinyModelConfig(arch="qwen2_5_vl")))
        tasks = load_tasks("imaging:finding_mcq_train")[:args.prompts]
        samples = args.prompts * args.group
        tokens = samples * args.new_tokens
        rows = []
        for engine, run in (("vllm_rollout_worker", vllm_rollout), ("hf_generate", hf_generate)):
            seconds = run(path, tasks, args.group, args.new_tokens, args.threads)
            rows.append({"engine": engine, "samples": samples, "new_tokens": args.new_tokens,
                         "threads": args.threads, "seconds": seconds, "images_s": samples / seconds,
                         "tokens_s": tokens / seconds})
            print(rows[-1], flush=True)
        rows[0]["speedup"] = rows[1]["seconds"] / rows[0]["seconds"]
        report("multimodal", rows)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()

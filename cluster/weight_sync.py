"""Moving the learner's weights to every rollout worker after each optimizer step.

Two transports behind `LearnerGroup.sync` (`cluster.weight_sync`): the object store (default without GPUs) and a
collective broadcast (default with GPUs: NCCL; gloo on CPU). Object-store transport: the learner packs parameters into flat
buckets of at most `bucket_mb`, puts each bucket once, and every rollout worker reads the same objects
(zero-copy numpy views on the same node). Workers consume buckets one at a time, so peak extra memory is
a bucket, not a model. Pack buffers are reused across rounds: writing onto warm pages is several times
faster than onto fresh ones.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import ray
import torch


@dataclass
class TensorSlot:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int          # in elements of the bucket's dtype
    numel: int


@dataclass
class WeightManifest:
    """What a rollout worker needs to load weights of `version`: bucket refs and where each tensor lies;
    `complete`: every weight of the model (else only those that changed, e.g. the layers LoRA trains)."""
    version: int
    buckets: list[tuple[ray.ObjectRef, list[TensorSlot]]]
    complete: bool = True

    @property
    def num_bytes(self) -> int:
        return sum(s.numel * torch.empty(0, dtype=getattr(torch, s.dtype)).element_size()
                   for _, slots in self.buckets for s in slots)


class WeightPublisher:
    """Lives in learner rank 0. `publish` returns a manifest; the previous round's objects are released first.
    `keep_buffers`: pack buffers stay allocated between rounds (faster writes, but resident through training)."""

    def __init__(self, bucket_mb: float = 256.0, keep_buffers: bool = True):
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.keep_buffers = keep_buffers
        self.buffers: dict[tuple[int, str], np.ndarray] = {}
        self.last: WeightManifest | None = None

    def _buffer(self, index: int, dtype: torch.dtype, numel: int) -> np.ndarray:
        key = (index, str(dtype))
        buf = self.buffers.get(key)
        if buf is None or buf.size < numel:
            buf = torch.empty(numel, dtype=dtype).numpy() if dtype != torch.bfloat16 else \
                np.empty(numel, dtype=np.uint16)
            if self.keep_buffers:
                self.buffers[key] = buf
        return buf[:numel]

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                complete: bool = True) -> WeightManifest:
        self.last = None  # drop our refs to the previous round before putting the new one
        buckets, pending, pending_bytes = [], [], 0

        def flush():
            nonlocal pending, pending_bytes
            by_dtype: dict[torch.dtype, list] = {}
            for name, t in pending:
                by_dtype.setdefault(t.dtype, []).append((name, t))
            for dtype, items in by_dtype.items():
                numel = sum(t.numel() for _, t in items)
                buf = self._buffer(len(buckets), dtype, numel)
                flat = torch.from_numpy(buf).view(dtype) if dtype == torch.bfloat16 else torch.from_numpy(buf)
                slots, offset = [], 0
                for name, t in items:
                    flat[offset:offset + t.numel()].copy_(t.reshape(-1))
                    slots.append(TensorSlot(name, str(dtype).removeprefix("torch."), tuple(t.shape), offset, t.numel()))
                    offset += t.numel()
                buckets.append((ray.put(buf), slots))
            pending, pending_bytes = [], 0

        for name, tensor in named_tensors:
            tensor = tensor.detach().to("cpu")
            pending.append((name, tensor))
            pending_bytes += tensor.numel() * tensor.element_size()
            if pending_bytes >= self.bucket_bytes:
                flush()
        if pending:
            flush()
        self.last = WeightManifest(version, buckets, complete)
        return self.last


def receive_buckets(manifest: WeightManifest) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """A manifest's buckets, fetched one at a time, each as its (name, tensor) pairs; tensors are read-only views on
    the shared bucket (the consumer copies them into its own parameters)."""
    for ref, slots in manifest.buckets:
        buf = ray.get(ref)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            flat = torch.from_numpy(buf)
        bucket = []
        for s in slots:
            dtype = getattr(torch, s.dtype)
            view = flat.view(dtype) if dtype == torch.bfloat16 else flat
            bucket.append((s.name, view[s.offset:s.offset + s.numel].view(s.shape)))
        yield bucket


def receive_weights(manifest: WeightManifest) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a manifest, fetching one bucket at a time (see `receive_buckets`)."""
    for bucket in receive_buckets(manifest):
        yield from bucket


# ---- collective transport: NCCL between GPUs, gloo on CPU ---------------------------------------------------------
# A process group of its own spans learner rank 0 (rank 0) and the rollout workers (ranks 1..R), apart from the
# learners' DeepSpeed group; each sync broadcasts the parameters one by one, straight into the engines' loaders.
# On a GPU cluster this keeps weights on the GPUs; here gloo runs the same code path on CPU.

def join_broadcast_group(host: str, port: int, world_size: int, rank: int, device: str):
    """Create (rank 0, which also hosts the store) or join the weight-broadcast group."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(minutes=5)
    store = dist.PrefixStore("medray-weights", dist.TCPStore(host, port, world_size, is_master=rank == 0,
                                                              timeout=timeout))
    if device == "cuda":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def _broadcast(group, tensor: torch.Tensor) -> None:
    import torch.distributed as dist
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def broadcast_weights(group, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Rank 0: send every tensor, in the order of the shared metadata."""
    for _, tensor in named_tensors:
        _broadcast(group, tensor.contiguous())


def receive_broadcast(group, meta: list[tuple[str, str, tuple[int, ...]]], device: str
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Ranks 1..R: (name, tensor) as each arrives; `meta` is (name, dtype, shape) in the sender's order."""
    for name, dtype, shape in meta:
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        _broadcast(group, tensor)
        yield name, tensor

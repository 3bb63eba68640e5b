"""ToolActor: one tool (actors.tools) as a Ray actor, its model and image cache resident for the actor's life.

Calls are batched (`run_batch` takes every call a rollout step produced for this tool) and asynchronous: the actor is
an asyncio actor whose tool runs on one worker thread, so batches execute one at a time (models need not be
thread-safe) while `health` and `stats` answer at once. A tool call only reads images and indexes, so Ray may
retry it on the restarted actor after a crash (`max_task_retries`): the episode waiting on it simply gets its answer
later. Counters live in the actor and start again from zero after a restart (`health()["restarted"]` says so).
"""
from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor

import ray

from actors.tools import ToolCall, ToolResult


def tool_actor_name(tool: str, replica: int) -> str:
    """Actors are named by role, as the Ray dashboard shows them: ToolActor-zoom_in-0."""
    return f"ToolActor-{tool}-{replica}"


@ray.remote(max_restarts=5, max_task_retries=3)
class ToolActor:
    """Hosts the registered tool ``tool``; ``tool_kwargs`` go to its constructor (weights path, retriever handle)."""

    def __init__(self, tool: str, threads: int = 1, **tool_kwargs):
        # before any numeric library starts its thread pool (Ray sets 1; an explicit budget per actor, as elsewhere)
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
        from actors.tools import make_tool

        started = time.perf_counter()
        self.tool = make_tool(tool, **tool_kwargs)
        self.load_s = time.perf_counter() - started
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tool-{tool}")
        self.counters = {"batches": 0, "calls": 0, "errors": 0, "seconds": 0.0, "max_batch": 0}

    async def run_batch(self, calls: list[ToolCall]) -> list[ToolResult]:
        results, seconds = await asyncio.get_running_loop().run_in_executor(self.worker, self._timed, calls)
        c = self.counters
        c["batches"] += 1
        c["calls"] += len(calls)
        c["errors"] += sum(r.error is not None for r in results)
        c["seconds"] += seconds
        c["max_batch"] = max(c["max_batch"], len(calls))
        return results

    def _timed(self, calls: list[ToolCall]) -> tuple[list[ToolResult], float]:
        """The batch and the seconds it took on the worker thread (not counting time queued behind other batches)."""
        started = time.perf_counter()
        return self.tool.run_batch(calls), time.perf_counter() - started

    async def health(self) -> dict:
        context = ray.get_runtime_context()
        return {"tool": self.tool.name, "ok": True, "pid": os.getpid(), "load_s": self.load_s,
                "restarted": context.was_current_actor_reconstructed}

    async def stats(self) -> dict:
        """Counters since this actor (re)started: batches, calls, errors, seconds inside the tool, largest batch."""
        c = self.counters
        return {"tool": self.tool.name, **c, "mean_batch": c["calls"] / c["batches"] if c["batches"] else 0.0,
                "seconds_per_call": c["seconds"] / c["calls"] if c["calls"] else 0.0}

"""RewardActor: scores a batch of trajectories with the configured reward components, in parallel."""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout

import ray

from actors.trajectory import Trajectory
from cluster.devices import step_peak_memory
from rewards.nci import group_nci, group_spread
from rewards.registry import is_diagnostic, is_stateful, make_reward

log = logging.getLogger("medray.rewards")


def combine(components_by_spec: list[dict[str, list[float]]], weights: list[float], n: int) -> list[float]:
    """total_i = sum over reward specs k of weight_k * (sum of spec k's components for sample i); diagnostics
    (`metric/...`) are not components of the reward."""
    total = [0.0] * n
    for comps, w in zip(components_by_spec, weights):
        for name, scores in comps.items():
            if is_diagnostic(name):
                continue
            for i, s in enumerate(scores):
                total[i] += w * s
    return total


@ray.remote(max_restarts=3, max_task_retries=2)
class RewardActor:
    """Holds the reward components (models stay resident) and scores batches.

    Components run concurrently in threads; one that raises or exceeds `timeout_s` is counted in `errors`
    and, with on_error="zero", scores 0 for the batch with a warning; with on_error="fail" the step fails.
    """

    def __init__(self, specs: list[dict], timeout_s: float, on_error: str, threads: int = 1):
        import torch
        torch.set_num_threads(threads)
        self.specs = specs
        self.rewards = [make_reward(s["name"], s.get("args", {})) for s in specs]
        self.timeout_s, self.on_error = timeout_s, on_error
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(specs)), thread_name_prefix="reward")

    def score(self, trajectories: list[Trajectory]) -> dict:
        start, n = time.perf_counter(), len(trajectories)
        futures = [self.pool.submit(fn, trajectories) for fn in self.rewards]
        by_spec, errors = [], {}
        for spec, fut in zip(self.specs, futures):
            try:
                comps = fut.result(timeout=self.timeout_s)
                bad = [k for k, v in comps.items() if len(v) != n]
                if bad:
                    raise ValueError(f"returned {bad} with a length other than the batch's {n}")
            except Exception as e:  # noqa: BLE001  a reward's failure is reported, never swallowed silently
                kind = "timeout" if isinstance(e, FutureTimeout) else type(e).__name__
                if self.on_error == "fail":
                    raise RuntimeError(f"reward {spec['name']!r} failed ({kind}): {e}") from e
                log.warning("reward %r failed (%s: %s); scoring 0 for %d samples", spec["name"], kind, e, n)
                errors[spec["name"]] = errors.get(spec["name"], 0) + 1
                comps = {spec["name"]: [0.0] * n}
            by_spec.append(comps)
        groups = [t.group for t in trajectories]
        return {**self.summarize(by_spec, groups), "by_spec": by_spec, "groups": groups, "errors": errors,
                "seconds": time.perf_counter() - start, "pid": os.getpid(),
                "actor": ray.get_runtime_context().get_actor_id(), "peak_memory_gb": step_peak_memory()}

    def summarize(self, by_spec: list[dict[str, list[float]]], groups: list[int]) -> dict:
        """The total reward per sample, the components by name, their NCI per group and their spread within groups."""
        components = {k: v for comps in by_spec for k, v in comps.items()}
        weights = [s.get("weight", 1.0) for s in self.specs]
        rewarding = {k: v for k, v in components.items() if not is_diagnostic(k)}
        nci = group_nci(rewarding, {k: w for comps, w in zip(by_spec, weights) for k in comps if k in rewarding},
                        groups)
        return {"total": combine(by_spec, weights, len(groups)), "components": components, "nci": nci,
                "spread": group_spread(rewarding, groups)}

    def stateful(self) -> bool:
        """Whether some reward needs `calibrate` on the whole batch each step."""
        return any(is_stateful(fn) for fn in self.rewards)

    def calibrate(self, scores: list[dict]) -> list[dict]:
        """The owner's part of a step: each stateful reward calibrates the raw components of every share (`score`'s
        results, in batch order) at once, updating its state once; then each share is summarized again. A share
        whose reward failed keeps its zeros."""
        for k, (spec, fn) in enumerate(zip(self.specs, self.rewards)):
            if not is_stateful(fn):
                continue
            shares = [s for s in scores if spec["name"] not in s["errors"]]
            if not shares:
                continue
            names = list(shares[0]["by_spec"][k])
            done = fn.calibrate({name: [v for s in shares for v in s["by_spec"][k][name]] for name in names})
            offset = 0
            for share in shares:
                n = len(share["groups"])
                share["by_spec"][k] = {name: values[offset:offset + n] for name, values in done.items()}
                offset += n
        return [{**s, **self.summarize(s["by_spec"], s["groups"])} for s in scores]

    def state_dict(self) -> dict:
        """The state of every stateful reward (ARMed's Adapt streams), keyed "<position>:<name>", for checkpoints."""
        return {f"{i}:{spec['name']}": fn.state_dict() for i, (spec, fn) in enumerate(zip(self.specs, self.rewards))
                if is_stateful(fn)}

    def load_state_dict(self, state: dict) -> None:
        for i, (spec, fn) in enumerate(zip(self.specs, self.rewards)):
            if f"{i}:{spec['name']}" in state:
                fn.load_state_dict(state[f"{i}:{spec['name']}"])

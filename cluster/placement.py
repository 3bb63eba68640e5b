"""Where each actor role runs: placement groups built from the config's resource layout."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import ray
from ray.autoscaler.sdk import request_resources
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config import ActorResources, ClusterConfig

ROLES = ("learner", "rollout", "reward")
log = logging.getLogger("medray.placement")


class PlacementError(RuntimeError):
    pass


@dataclass
class Placement:
    """One placement group per role; bundle i of a role hosts that role's actor i."""
    groups: dict[str, PlacementGroup]
    resources: dict[str, ActorResources]

    def options(self, role: str, index: int, name: str) -> dict:
        """Ray actor options that put actor `index` of `role` on its bundle, named for the dashboard."""
        res = self.resources[role]
        return {"num_cpus": res.actor_cpus, "num_gpus": res.actor_gpus, "resources": dict(res.resources), "name": name,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=self.groups[role], placement_group_bundle_index=index)}

    def remove(self) -> None:
        for group in self.groups.values():
            ray.util.remove_placement_group(group)


def check_fits(cfg: ClusterConfig, available: dict, roles: tuple[str, ...] = ROLES,
               others: dict[str, dict[str, float]] | None = None) -> None:
    """Fail early, naming the fields, when the layout asks for more than the cluster has. `others`: actors outside
    the placement groups (tool actors), {config field: {"num": actors, "CPU": each, "GPU": each}}, counted against
    the same totals."""
    custom = sorted({key for role in roles for key in getattr(cfg, role).resources})
    for key in ("CPU", "GPU", *custom):
        field = f"num_{key.lower()}s" if key in ("CPU", "GPU") else f"resources.{key}"
        need = {f"cluster.{r}": (getattr(cfg, r).num, amount(getattr(cfg, r), key)) for r in roles}
        need.update({name: (demand["num"], demand.get(key, 0.0)) for name, demand in (others or {}).items()})
        total = sum(n * each for n, each in need.values())
        if total > available.get(key, 0) + 1e-9:
            detail = ", ".join(f"{name}: {n} x {each:g}" for name, (n, each) in need.items() if n * each)
            sharded = any(getattr(cfg, r).tensor_parallel_size > 1 for r in roles)
            raise PlacementError(f"the layout needs {total:g} {key} ({detail}) but the cluster has "
                                 f"{available.get(key, 0):g}; lower the {field}"
                                 f"{', the tensor_parallel_size' if sharded else ''} or the actor counts named")


def amount(res: ActorResources, key: str) -> float:
    """What one actor of a role takes of resource `key` (CPU, GPU or a custom one); every shard of a
    tensor-parallel engine."""
    return {"CPU": res.actor_cpus, "GPU": res.actor_gpus}.get(key, res.resources.get(key, 0.0))


def bundles(cfg: ClusterConfig, roles: tuple[str, ...] = ROLES) -> dict[str, list[dict]]:
    """Each role's bundles: one {CPU, GPU} per actor, sized for all of a tensor-parallel engine's shards (its worker
    processes run inside the actor's reservation)."""
    out = {}
    for role in roles:
        res: ActorResources = getattr(cfg, role)
        gpus = {"GPU": res.actor_gpus} if res.actor_gpus else {}
        out[role] = [{"CPU": res.actor_cpus, **gpus, **res.resources}] * res.num
    return out


def place(cfg: ClusterConfig, roles: tuple[str, ...] = ROLES, timeout_s: float | None = None,
          others: dict[str, dict[str, float]] | None = None, progress_every_s: float = 30.0) -> Placement:
    """Reserve every role's bundles up front, so a run never starts half-placed; `others` as in `check_fits`.

    On a fixed cluster a layout larger than the cluster is refused at once (`check_fits`). With `cluster.autoscale`
    the whole demand goes to the autoscaler (`request_resources`) and the placement groups wait for the nodes it
    starts, saying every `progress_every_s` which roles are still waiting. Either way, groups not ready after
    `timeout_s` (default `cluster.placement_timeout_s`) are removed and PlacementError names the roles left."""
    timeout_s = cfg.placement_timeout_s if timeout_s is None else timeout_s
    wanted = bundles(cfg, roles)
    if cfg.autoscale:
        tools = [{"CPU": d.get("CPU", 0.0), **({"GPU": d["GPU"]} if d.get("GPU") else {})}
                 for d in (others or {}).values() for _ in range(int(d["num"]))]
        request_resources(bundles=[b for role in roles for b in wanted[role]] + tools)
    else:
        check_fits(cfg, ray.cluster_resources(), roles, others)
    groups = {role: placement_group(wanted[role], strategy=cfg.placement_strategy, name=f"medray-{role}")
              for role in roles}
    try:
        wait_for(cfg, groups, timeout_s, progress_every_s)
    finally:
        if cfg.autoscale:  # the placement groups now hold (or no longer want) the nodes: drop the standing request
            request_resources(bundles=[])
    return Placement(groups, {role: getattr(cfg, role) for role in roles})


def wait_for(cfg: ClusterConfig, groups: dict[str, PlacementGroup], timeout_s: float, progress_every_s: float) -> None:
    """Until every group is ready, saying which roles still wait; past `timeout_s` all groups are removed and
    PlacementError names the roles left."""
    waiting, started = {group.ready(): role for role, group in groups.items()}, time.monotonic()
    while waiting:
        left = timeout_s - (time.monotonic() - started)
        if left <= 0:
            for group in groups.values():
                ray.util.remove_placement_group(group)
            raise PlacementError(f"placement not ready after {timeout_s:.0f}s, still waiting for "
                                 f"{describe(cfg, waiting.values())}; cluster resources now: "
                                 f"{ray.available_resources()}")
        ready, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=min(progress_every_s, left))
        for ref in ready:
            del waiting[ref]
        if waiting:
            log.info("waiting for %s (%.0f s of %.0f s)", describe(cfg, waiting.values()),
                     time.monotonic() - started, timeout_s)


def describe(cfg: ClusterConfig, roles) -> str:
    """'cluster.rollout: 8 x {CPU: 4, GPU: 1}, ...' for the roles named."""
    parts = []
    for role in roles:
        shape = ", ".join(f"{key}: {value:g}" for key, value in bundles(cfg, (role,))[role][0].items())
        parts.append(f"cluster.{role}: {getattr(cfg, role).num} x {{{shape}}}")
    return ", ".join(parts)

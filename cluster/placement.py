"""Where each actor role runs: placement groups built from the config's resource layout."""
from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from learners.config import ActorResources, ClusterConfig

ROLES = ("learner", "rollout", "reward")


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
        return {"num_cpus": res.num_cpus, "num_gpus": res.num_gpus, "name": name,
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
    for key in ("CPU", "GPU"):
        field = f"num_{key.lower()}s"
        need = {f"cluster.{r}": (getattr(cfg, r).num, getattr(getattr(cfg, r), field)) for r in roles}
        need.update({name: (demand["num"], demand.get(key, 0.0)) for name, demand in (others or {}).items()})
        total = sum(n * each for n, each in need.values())
        if total > available.get(key, 0) + 1e-9:
            detail = ", ".join(f"{name}: {n} x {each:g}" for name, (n, each) in need.items() if n * each)
            raise PlacementError(f"the layout needs {total:g} {key} ({detail}) but the cluster has "
                                 f"{available.get(key, 0):g}; lower the {field} or the actor counts named")


def place(cfg: ClusterConfig, roles: tuple[str, ...] = ROLES, timeout_s: float = 120.0,
          others: dict[str, dict[str, float]] | None = None) -> Placement:
    """Reserve every role's bundles up front, so a run never starts half-placed; `others` as in `check_fits`."""
    check_fits(cfg, ray.cluster_resources(), roles, others)
    groups, resources = {}, {}
    for role in roles:
        res: ActorResources = getattr(cfg, role)
        bundle = {"CPU": res.num_cpus, **({"GPU": res.num_gpus} if res.num_gpus else {})}
        groups[role] = placement_group([bundle] * res.num, strategy=cfg.placement_strategy, name=f"medray-{role}")
        resources[role] = res
    ready, _ = ray.wait([g.ready() for g in groups.values()], num_returns=len(groups), timeout=timeout_s)
    if len(ready) < len(groups):
        raise PlacementError(f"placement groups not ready after {timeout_s:.0f}s; cluster resources: "
                             f"{ray.available_resources()}")
    return Placement(groups, resources)

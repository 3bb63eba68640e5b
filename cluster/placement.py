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


def check_fits(cfg: ClusterConfig, available: dict, roles: tuple[str, ...] = ROLES) -> None:
    """Fail early, naming the fields, when the layout asks for more than the cluster has."""
    for key in ("CPU", "GPU"):
        field = f"num_{key.lower()}s"
        per_actor = {r: getattr(getattr(cfg, r), field) for r in roles}
        need = {r: getattr(cfg, r).num * per_actor[r] for r in roles}
        if sum(need.values()) > available.get(key, 0) + 1e-9:
            detail = ", ".join(f"cluster.{r}: {getattr(cfg, r).num} x {per_actor[r]:g}" for r, v in need.items() if v)
            raise PlacementError(f"the layout needs {sum(need.values()):g} {key} ({detail}) but the cluster has "
                                 f"{available.get(key, 0):g}; lower cluster.<role>.num_{key.lower()}s or .num")


def place(cfg: ClusterConfig, roles: tuple[str, ...] = ROLES, timeout_s: float = 120.0) -> Placement:
    """Reserve every role's bundles up front, so a run never starts half-placed."""
    check_fits(cfg, ray.cluster_resources(), roles)
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

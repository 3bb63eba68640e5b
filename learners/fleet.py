"""The actors a run or an evaluation stands on, started in order and ended together: Ray (started or joined here and
nowhere else on these paths), the placement of the roles, the service actors (environment, judge), the rollout
workers, and the reward actors of a training run. Training (learners/trainer.py) and evaluation
(learners/evaluate.py) both take one:

    with Fleet(cfg, roles) as fleet:      # or fleet.close() in a `finally`
        fleet.place(); fleet.start_services(); fleet.start_workers(model_path)
        ...

`close` ends whatever was started, in reverse, and takes a fleet that stopped part-way: an attribute still empty is
a part that never started.
"""
from __future__ import annotations

import logging
from typing import Callable

import ray

from actors.rollout_worker import RolloutWorker
from cluster.placement import Placement, place
from cluster.ray_session import start_or_join
from learners.services import start_environment, start_judge, tool_demand
from rewards.reward_actor import RewardActor

log = logging.getLogger("medray.fleet")


class Fleet:
    def __init__(self, cfg, roles: tuple[str, ...], judge: bool = True,
                 on_ray_start: Callable[[], None] | None = None):
        """`roles`: the placement roles to reserve; `judge`: start the config's judge (when it has a `judge`
        section); `on_ray_start`: called once Ray is up (the driver's console routing of actor output)."""
        self.cfg, self.roles, self.with_judge, self.on_ray_start = cfg, roles, judge, on_ray_start
        self.joined = False
        self.placement: Placement | None = None
        self.environment = self.judge = None
        self.workers: list = []
        self.rewarders: list = []
        self.others: list = []  # actors started beside the fleet's own (an image retriever), ended with it

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def join_ray(self) -> None:
        """Start a local Ray or join the cluster (cluster/ray_session.py); once per fleet."""
        if self.joined:
            return
        start_or_join(self.cfg.cluster)
        self.joined = True
        if self.on_ray_start is not None:
            self.on_ray_start()

    def place(self) -> Placement:
        """Reserve the roles' bundles (placement groups); tool actors' demand is checked beside them."""
        self.join_ray()
        self.placement = place(self.cfg.cluster, self.roles, others=tool_demand(self.cfg))
        return self.placement

    def start_services(self) -> None:
        """The environment (retrievers, or the tool Gym) and, when asked and configured, the judge."""
        self.environment = start_environment(self.cfg, self.placement)
        self.judge = start_judge(self.cfg, self.placement) if self.with_judge else None

    def start_workers(self, model_path: str, name: str = "RolloutWorker", **kwargs) -> list:
        """One RolloutWorker per `cluster.rollout` bundle, loading `model_path`, acting on the environment."""
        self.workers = [RolloutWorker.options(**self.placement.options("rollout", i, f"{name}-{i}")).remote(
            model_path, **self.cfg.engine_args(), **kwargs, environment=self.environment)
            for i in range(self.cfg.cluster.rollout.num)]
        return self.workers

    def start_rewarders(self, cfg) -> list:
        """Reward actors for `cfg`'s reward spec (a stage's), in place of any started before; ready when returned."""
        for actor in self.rewarders:
            ray.kill(actor)
        res = self.cfg.cluster.reward
        self.rewarders = [RewardActor.options(**self.placement.options("reward", i, f"RewardActor-{i}")).remote(
            [s.model_dump() for s in cfg.rewards.components], cfg.rewards.timeout_s, cfg.rewards.on_error,
            res.threads) for i in range(res.num)]
        ray.get([r.__ray_ready__.remote() for r in self.rewarders])
        return self.rewarders

    def service_actors(self) -> list:
        return (self.environment.actors() if self.environment else []) + ([self.judge] if self.judge else [])

    def close(self) -> None:
        """End every actor started and release the placement, so the next run (or test) in this Ray session finds
        them free. Removing the placement groups also ends actors in them no handle here reaches (the ranks of a
        learner group that never formed)."""
        for actor in self.workers + self.rewarders + self.others + self.service_actors():
            ray.kill(actor)
        if self.placement is not None:
            self.placement.remove()

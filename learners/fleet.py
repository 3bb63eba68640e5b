"""The actors a run or an evaluation stands on, started in order and ended together: Ray (started or joined here and
nowhere else on these paths), the placement of the roles, the service actors (environment, judge), the rollout
workers, and the reward actors of a training run. Training (learners/trainer.py) and evaluation
(learners/evaluate.py) both take one:

    with Fleet(cfg, roles) as fleet:      # or fleet.close() in a `finally`
        fleet.place(); fleet.start_services(); fleet.start_workers(model_path)
        ...

`close` ends whatever was started, in reverse, and takes a fleet that stopped part-way: an attribute still empty is
a part that never started. `send_shares` and `gather_shares` are how both hand work to the rollout workers: a share
lost with its worker is generated again.
"""
from __future__ import annotations

import logging
from typing import Callable

import ray

from actors.rollout_worker import RolloutCall, RolloutWorker
from actors.trajectory import RolloutSummary
from cluster.placement import Placement, place
from cluster.ray_session import ACTOR_LOST, start_or_join, wait_until_ready
from learners.memory_plan import check_local_run
from learners.services import start_environment, start_judge, tool_demand
from rewards.reward_actor import RewardActor

log = logging.getLogger("medray.fleet")


def send_shares(workers: list, calls: list[RolloutCall]) -> tuple[list, list]:
    """One `rollout` call per worker (`calls[i]` to `workers[i]`): (trajectory refs, summary refs)."""
    refs = [worker.rollout.options(num_returns=2).remote(**vars(call)) for worker, call in zip(workers, calls)]
    return [t for t, _ in refs], [s for _, s in refs]


def gather_shares(workers: list, calls: list[RolloutCall], trajectories: list, summaries: list, what: str,
                  version: int = 0, restore: Callable[[int], None] | None = None,
                  attempts: int = 3) -> list[RolloutSummary]:
    """The summaries of the shares `send_shares` sent, once every worker's has arrived. A share lost with its worker
    (killed, out of memory), or sampled by a worker Ray restarted with weights older than `version`, is generated
    again by the same call (the same seeds, so the same episodes) once the worker answers again and `restore(i)` has
    given worker i the weights wanted (None: the weights it starts with are those, as when evaluating a checkpoint);
    its refs in `trajectories` and `summaries` are replaced. Raises after `attempts` regenerations of one share;
    `what` names the work in messages ("step 3")."""
    gathered = []
    for i, worker in enumerate(workers):
        for attempt in range(attempts + 1):
            try:
                summary = ray.get(summaries[i])
                if summary.version >= version:
                    gathered.append(summary)
                    break
                problem = f"restarted with the weights of version {summary.version}"
            except ACTOR_LOST as e:
                problem = f"lost ({type(e).__name__})"
            if attempt == attempts:
                raise RuntimeError(f"RolloutWorker-{i} failed {attempts + 1} times in {what}: {problem}")
            log.warning("RolloutWorker-%d %s in %s; generating its share again", i, problem, what)
            wait_until_ready(worker)
            if restore is not None:
                restore(i)
            (trajectories[i],), (summaries[i],) = send_shares([worker], [calls[i]])
    return gathered


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
        check_local_run(self.cfg, self.roles)  # a run that cannot fit this machine's memory stops before Ray starts
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

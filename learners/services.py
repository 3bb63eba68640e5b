"""The service actors of a run beside rollout, learner and reward roles: what the policy acts on during rollouts
(retrievers) and what rewards call (the LLM judge) — which start, with what, and where (one placement bundle each) —
and how their restarts are counted."""
from __future__ import annotations

import os
from pathlib import Path

import ray

from actors.environment import Environment
from actors.retrieval_env import RetrievalEnvironment
from cluster.placement import Placement
from cluster.ray_session import ACTOR_LOST


def policy_acts(cfg) -> bool:
    """Whether some stage's grammar lets the policy act (an action tag): only then is there an environment."""
    return any(cfg.for_stage(i).rollout.grammar.action_tag for i in range(len(cfg.stage_plan())))


def ensure_run_index(cfg) -> Path:
    """The run's retrieval index directory (`retrieval.index_dir`, else the cache's), built first unless current."""
    from indexing.build_index import default_index_dir, ensure_index

    r = cfg.retrieval
    index_dir = Path(r.index_dir) if r.index_dir else default_index_dir(r.kb, r.index.kind, r.shards)
    ensure_index(r.kb, index_dir, r.encoder, r.index, shards=r.shards, progress=True)
    return index_dir


def environment_roles(cfg) -> tuple[str, ...]:
    """The placement roles the run's environment needs: none unless the policy acts and a retriever serves it
    (directly, or as the tool Gym's retrieve_knowledge). Tool actors take the resources their own section gives
    them (`tools.tools.<name>`), outside these placement groups."""
    return ("retriever",) if policy_acts(cfg) and cfg.retrieval is not None else ()


def tool_demand(cfg) -> dict[str, dict[str, float]]:
    """What the tool actors take, per `tools.tools.<name>` field, for `place(..., others=)`: they run beside the
    placement groups, so without this a layout could pass the check and then wait forever for their CPUs."""
    if cfg.tools is None or not policy_acts(cfg):
        return {}
    return {f"tools.tools.{name}": {"num": spec.replicas, "CPU": spec.num_cpus, "GPU": spec.num_gpus}
            for name, spec in cfg.tools.tools.items()}


def service_roles(cfg) -> tuple[str, ...]:
    """Every placement role beyond the trainer's own: the environment's, and the judge's when configured."""
    return environment_roles(cfg) + (("judge",) if cfg.judge is not None else ())


def start_judge(cfg, placement: Placement):
    """The JudgeActor, named "JudgeActor" so that judge rewards in every reward actor find it; None without a judge
    section."""
    if cfg.judge is None:
        return None
    from actors.judge import JudgeActor
    res = cfg.cluster.judge
    judge = JudgeActor.options(**placement.options("judge", 0, "JudgeActor")).remote(
        cfg.judge.model_dump(), res.threads, res.tensor_parallel_size)
    ray.get(judge.stats.remote())  # started (model loaded), or its error surfaces here
    return judge


def start_environment(cfg, placement: Placement) -> Environment | None:
    """Build the index if needed and start the Retriever actors on their bundles, and the tool actors when the run
    has a tools section (the Gym is then the environment, its retrieve_knowledge tool searching the retriever);
    None for a single-turn grammar."""
    if not policy_acts(cfg):
        return None
    retriever = None
    if "retriever" in environment_roles(cfg):
        from actors.retriever import ShardedRetriever
        retriever = ShardedRetriever(ensure_run_index(cfg), threads=cfg.cluster.retriever.threads,
                                     config=cfg.retrieval.search,
                                     actor_options=lambda i: placement.options("retriever", i, f"Retriever-{i}"))
    if cfg.tools is not None:
        from actors.gym import make_tool_environment
        return make_tool_environment(cfg.tools, retriever)
    return retrieval_environment(cfg, retriever)


def retrieval_environment(cfg, retriever) -> RetrievalEnvironment:
    """The run's RetrievalEnvironment over `retriever` (actors, or a LocalRetriever for the scripted expert)."""
    r = cfg.retrieval
    return RetrievalEnvironment(retriever, top_k=r.search.top_k, timeout_s=r.timeout_s, show=r.show,
                                link_options=r.link_options, passage_chars=r.passage_chars, paging=r.paging,
                                rank_options=r.rank_options)


def service_actors(environment: Environment | None, judge) -> dict[str, list]:
    """The service actors by metrics role: the environment's (retrievers, or the Gym's tool actors) and the judge."""
    roles = {environment.role: environment.actors()} if environment else {}
    return {**roles, **({"judge": [judge]} if judge else {})}


def count_restarts(actors_by_role: dict[str, list], pids: dict, restarts: dict[str, int]) -> None:
    """A service actor that Ray restarted answers from a new process: count it in `restarts[role]` (`pids` keeps
    the process id each one answered from). Ray retries the calls it lost on the new process, so the run goes on;
    one still restarting is checked next time."""
    for role, actors in actors_by_role.items():
        restarts.setdefault(role, 0)
        calls = [actor.__ray_call__.remote(_process_id) for actor in actors]
        for i, call in enumerate(calls):
            try:
                pid = ray.get(call, timeout=30)
            except ACTOR_LOST + (ray.exceptions.GetTimeoutError,):
                continue
            restarts[role] += changed_process(pids, (role, i), pid)


def changed_process(pids: dict, key, pid: int) -> bool:
    """Whether the actor `key` answered from another process than it did last time; `pids` keeps the latest."""
    changed = pids.setdefault(key, pid) != pid
    pids[key] = pid
    return changed


def _process_id(_actor) -> int:
    return os.getpid()

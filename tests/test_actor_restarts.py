"""Actors Ray restarts rebuild themselves from their constructor arguments: those arguments hold no actor handle
(an object reference Ray does not keep for a restart, ray-project/ray#53727), only names the actor looks up again.
So a run's start-up logs no "constructor arguments in the object store" error, and a killed rollout or tool actor
comes back able to reach its retriever."""
import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

RESTART_ERROR = "has constructor arguments in the object store"
GRAMMAR = {"action_tag": "query", "observation_tag": "retrieve", "max_turns": 1, "max_response_tokens": 96,
           "max_observation_tokens": 48}


@pytest.fixture(scope="module")
def hpo_index():
    from indexing.build_index import default_index_dir, ensure_index
    from indexing.retrieval_index import IndexConfig

    index = default_index_dir("hpo", "none", 1)
    ensure_index("hpo", index, config=IndexConfig(kind="none"))
    return index


def named_retriever(index, name: str):
    from actors.retriever import ShardedRetriever
    return ShardedRetriever(index, config={"mode": "sparse"}, actor_options={"num_cpus": 0, "name": name})


def restarted(actor, timeout_s: float = 300.0) -> int:
    """Kill `actor` so that Ray restarts it; the new process id once its constructor has run again."""
    import ray

    before = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
    ray.kill(actor, no_restart=False)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:  # the kill lands asynchronously: the old process may still answer first
            pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
            if pid != before:
                return pid
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        time.sleep(0.5)
    pytest.fail("the killed actor did not come back")


def test_a_restarted_rollout_worker_rebuilds_its_environment_and_runs_episodes(ray_session, tiny_model_path,
                                                                               hpo_index):
    import ray
    from vllm.sampling_params import StructuredOutputsParams

    from actors.retrieval_env import RetrievalEnvironment
    from actors.rollout_worker import RolloutWorker
    from learners.data import load_tasks

    retriever = named_retriever(hpo_index, "RestartRetriever-0")
    worker = RolloutWorker.options(num_cpus=0, name="RestartRolloutWorker").remote(
        str(tiny_model_path), seed=0, threads=1, max_model_len=512, kv_cache_gb=0.25, grammar=GRAMMAR,
        environment=RetrievalEnvironment(retriever, top_k=2))
    try:
        restarted(worker)
        sampling = {"temperature": 1.0, "max_tokens": 32,  # every episode searches: the environment is called
                    "structured_outputs": StructuredOutputsParams(regex=r"<query>[a-z ]{4,24}</query>")}
        trajectories, summary = ray.get(worker.rollout.remote(load_tasks("hpo:mcq_train")[:2], [0, 1], 2, sampling,
                                                              seed=1))
    finally:
        ray.kill(worker)
        for actor in retriever.actors:
            ray.kill(actor)
    # each episode's search reached the retriever (random queries may match no document)
    assert summary.env_calls == 4 and summary.env_errors == 0
    assert all(t.turns and t.turns[0]["error"] is None for t in trajectories)


def test_a_restarted_tool_actor_searches_through_its_retriever(ray_session, hpo_index):
    import ray

    from actors.gym import ToolsConfig, make_tool_environment
    from actors.tools import ToolCall, ToolContext
    from actors.tools.base import QueryArgs

    retriever = named_retriever(hpo_index, "ToolRestartRetriever-0")
    env = make_tool_environment(ToolsConfig(tools={"retrieve_knowledge": {"num_cpus": 0}}), retriever)
    try:
        (actor,) = env.tool_actors["retrieve_knowledge"]
        restarted(actor)
        (result,) = ray.get(actor.run_batch.remote([ToolCall(QueryArgs(query="seizures"), ToolContext())]))
    finally:
        env.shutdown()
        for actor in retriever.actors:
            ray.kill(actor)
    assert result.error is None and result.measurements["hits"] > 0


STARTUP = """
import sys
import ray
from actors.gym import ToolsConfig, make_tool_environment
from actors.retrieval_env import RetrievalEnvironment
from actors.retriever import ShardedRetriever
from actors.rollout_worker import RolloutWorker

ray.init(address=sys.argv[1])
retriever = ShardedRetriever(sys.argv[2], config={"mode": "sparse"},
                             actor_options={"num_cpus": 0, "name": "Retriever-0"})
tools = make_tool_environment(ToolsConfig(tools={"retrieve_knowledge": {"num_cpus": 0}}), retriever)
workers = [RolloutWorker.options(num_cpus=0).remote(sys.argv[3], seed=0, threads=1, environment=environment)
           for environment in (RetrievalEnvironment(retriever, top_k=2), tools)]


@ray.remote(max_restarts=1)
class HoldsAHandle:  # the control: what Ray reports for a handle among the arguments
    def __init__(self, handle):
        pass


HoldsAHandle.options(num_cpus=0).remote(retriever.actors[0])
for actor in workers + tools.actors() + retriever.actors:
    ray.kill(actor)
"""


def test_starting_the_actors_logs_no_restart_error(ray_session, tiny_model_path, hpo_index):
    """Rollout workers with a retrieval or tool environment, and a tool actor searching a retriever, start as a run
    starts them, in a driver of their own (Ray reports this once per process): the one report is the control's."""
    import ray

    proc = subprocess.run([sys.executable, "-c", STARTUP, ray.get_runtime_context().gcs_address, str(hpo_index),
                           str(tiny_model_path)], capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [line for line in (proc.stdout + proc.stderr).splitlines() if RESTART_ERROR in line]
    assert len(reports) == 1 and "class name: 'HoldsAHandle'" in reports[0], reports

"""The chaos benchmark's run at test size (benchmarks/bench_chaos.py, its killer and its checks): a short tiny-model
run that loses a learner rank, a rollout worker, a reward actor and a retriever, one at a time, and comes out whole:
every step trained on its whole batch, sampled with the current weights."""
import json

import pytest

pytestmark = pytest.mark.slow


def test_a_run_that_loses_an_actor_of_every_role_completes_whole(ray_session, tiny_model_path, tmp_path):
    from benchmarks.bench_chaos import SMALL_BATCH, Killer, chaos_config, check_run, timed_run

    # steps of under a second: enough of them that the run outlasts four kills 5-10 s apart and their recoveries
    out, steps, plan = tmp_path / "run", 48, ["LearnerWorker", "RolloutWorker", "RewardActor", "Retriever"]
    killer = Killer(out, steps, every=(5.0, 10.0), max_kills=len(plan), plan=plan, recover_timeout_s=120.0)
    _, error = timed_run(chaos_config(out, steps, 3, len(plan), *SMALL_BATCH), killer)
    assert [k["role"] for k in killer.kills] == plan, killer.kills
    failed = {name: problem for name, problem in check_run(out, steps, killer.kills, error).items() if problem}
    assert failed == {}
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = logged[-1]
    # the learner group was restarted once, from a checkpoint; the others were restarted by Ray and noticed (a
    # worker's loss counts whether the kill hit a rollout, generated again, or a sync, read again)
    assert last["actor_restarts/learner"] == 1 and last["actor_restarts/retriever"] == 1
    assert last["actor_restarts/rollout"] >= 1 and last["actor_restarts/reward"] >= 1
    # every step trained on its whole batch, a regenerated share sampled with the current weights
    steps_logged = [m for m in logged if m["step"] > 0]
    assert all(m["version_lag"] == 0 for m in steps_logged)
    assert all(m["fidelity_max_abs_diff"] <= 1e-4 for m in steps_logged if "fidelity_max_abs_diff" in m)

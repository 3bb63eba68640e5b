"""The chaos benchmark's run at test size (benchmarks/bench_chaos.py, its killer and its checks): a short tiny-model
run that loses a learner rank, a rollout worker and a reward actor, one at a time, and comes out whole."""
import json

import pytest

pytestmark = pytest.mark.slow


def test_a_run_that_loses_an_actor_of_three_roles_completes_whole(ray_session, tiny_model_path, tmp_path):
    from benchmarks.bench_chaos import SMALL_BATCH, Killer, chaos_config, check_run, timed_run

    # steps of under a second: enough of them that the run outlasts three kills 5-10 s apart and their recoveries
    out, steps, plan = tmp_path / "run", 40, ["LearnerWorker", "RolloutWorker", "RewardActor"]
    killer = Killer(out, steps, every=(5.0, 10.0), max_kills=len(plan), plan=plan, recover_timeout_s=120.0)
    _, error = timed_run(chaos_config(out, steps, 3, len(plan), *SMALL_BATCH), killer)
    assert [k["role"] for k in killer.kills] == plan, killer.kills
    failed = {name: problem for name, problem in check_run(out, steps, killer.kills, error).items() if problem}
    assert failed == {}
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    # the learner group was restarted once, from a checkpoint; the others were restarted by Ray and noticed
    assert last["actor_restarts/learner"] == 1
    assert last["actor_restarts/rollout"] >= 1 and last["actor_restarts/reward"] >= 1

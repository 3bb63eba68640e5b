"""Actors killed in the middle of a real run: the run completes, every step trains on whole scored groups, and the
metrics show what happened."""
import json
import threading
import time

import pytest

from learners.config import load_config
from learners.trainer import Trainer

pytestmark = pytest.mark.slow


def kill_when(out, step: int, name: str, delay_s: float, done: list):
    """Kill actor `name` `delay_s` seconds after metrics.jsonl shows step `step` (Ray restarts it)."""
    import ray

    def watch():
        path = out / "metrics.jsonl"
        while not (path.exists() and len(path.read_text().splitlines()) >= step):
            time.sleep(0.2)
        time.sleep(delay_s)
        ray.kill(ray.get_actor(name), no_restart=False)
        done.append(name)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_killed_rollout_reward_and_retriever_actors_do_not_stop_the_run(ray_session, tiny_model_path, tmp_path):
    out = tmp_path / "run"
    cfg = load_config("configs/tiny.yaml", [
        f"output_dir={out}", "total_steps=4", "rollout.prompts_per_step=4", "rollout.group_size=4",
        "rollout.max_new_tokens=16", "learner.micro_batch_size=8", "checkpoint.every=10", "logging.progress_bar=false",
        "rollout.fidelity_check_every=1"])
    killed: list[str] = []
    # step 2's generation is under way right after step 1 is logged; the others die between or during calls
    threads = [kill_when(out, 1, "RolloutWorker-0", 0.0, killed), kill_when(out, 2, "RewardActor-0", 0.0, killed),
               kill_when(out, 3, "Retriever-0", 0.0, killed)]
    history = Trainer(cfg).fit()
    for thread in threads:
        thread.join(timeout=5)
    assert killed == ["RolloutWorker-0", "RewardActor-0", "Retriever-0"]
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    last = history[-1]
    # the worker's loss is counted whether the kill hit a rollout (generated again) or the sync (read again)
    assert last["actor_restarts/rollout"] >= 1 and last["actor_restarts/reward"] >= 1
    assert last["actor_restarts/retriever"] == 1
    # every step trained on its whole batch, and the regenerated share was sampled with the current weights
    assert all(h["fidelity_max_abs_diff"] <= 1e-4 for h in history)
    assert all(h["version_lag"] == 0 for h in history)
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [1, 2, 3, 4]


def test_a_lost_learner_rank_stops_the_group_with_a_clear_error_instead_of_hanging(ray_session, tiny_model_path):
    """Rank 1 dies (OOM-killed, say) while rank 0 trains: rank 0 would wait in DeepSpeed's allreduce for the
    collective timeout (30 min). The group fails within seconds instead, naming the rank and how to resume."""
    import ray

    from actors.trajectory import Trajectory
    from cluster.placement import place
    from learners.learner_group import LearnerGroup, LearnerRankFailed

    cfg = load_config("configs/tiny.yaml", ["output_dir=unused"])
    placement = place(cfg.cluster, roles=("learner",))
    group = LearnerGroup(cfg, placement, str(tiny_model_path))
    trajs = [Trajectory(task={}, group=0, prompt_ids=[1, 2, 3], response_ids=[4, 5, 6], logprobs=[-1.0] * 3,
                        loss_mask=[1] * 3, text="", finish_reason="stop", weight_version=0) for _ in range(4)]
    try:
        ray.kill(group.ranks[1])
        start = time.monotonic()
        with pytest.raises(LearnerRankFailed, match=r"LearnerWorker-1 failed during a grpo step(.|\n)*resume=true"):
            group.train([ray.put(trajs)], [1.0, -1.0, 1.0, -1.0], cfg)
        assert time.monotonic() - start < 120
    finally:
        group.shutdown()
        placement.remove()

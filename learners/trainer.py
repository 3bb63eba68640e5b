"""The trainer loop: sample prompts -> rollouts -> rewards -> advantages -> learner update -> weight sync.

The driver only moves object refs and small numbers; trajectories go from rollout workers to reward actors
and learners directly through the object store.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray
import torch
import yaml

from actors.environment import derive_seed
from actors.rollout_worker import RolloutWorker
from cluster.placement import Placement, place
from cluster.ray_session import start_or_join
from learners import checkpoint as ckpt
from learners.algorithm import group_advantages
from learners.config import RunConfig
from learners.data import PromptSampler, load_tasks
from learners.learner_group import LearnerGroup
from learners.metrics import MetricsLogger
from learners.tiny_models import ensure_tiny_model
from rewards.reward_actor import RewardActor

log = logging.getLogger("medray.trainer")


@dataclass
class StepRollouts:
    """One step's rollouts in flight: per-worker trajectory refs and summary refs."""
    step: int
    trajectories: list[ray.ObjectRef]
    summaries: list[ray.ObjectRef]


class Trainer:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.ckpt_root = self.out / "checkpoints"

    # ---- set-up -------------------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        if not cfg.resume and ((self.out / "metrics.jsonl").exists() or self.ckpt_root.exists()):
            raise FileExistsError(f"output_dir {self.out} already holds a run; pass resume=true to continue it, or "
                                  f"choose another output_dir (nothing there was changed)")
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.yaml").write_text(yaml.safe_dump(cfg.dump(), sort_keys=False))
        start_or_join(cfg.cluster)
        self.step, resume_from = 0, None
        if cfg.resume:
            resume_from = ckpt.latest_valid(self.ckpt_root)
            if resume_from is None:
                log.warning("resume=true but no valid checkpoint under %s; starting from step 0", self.ckpt_root)
            else:
                self.step = ckpt.read_state(resume_from)["step"]
        self.base_model = cfg.model.path or str(ensure_tiny_model(cfg.model.tiny))
        policy_path = str(resume_from) if resume_from else self.base_model

        from transformers import AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(self.base_model)
        self.tasks = self._load_tasks()
        self.sampler = PromptSampler(len(self.tasks), cfg.rollout.prompts_per_step, cfg.seed, cfg.data.shuffle)
        self.placement: Placement = place(cfg.cluster)
        self.workers = self._start_rollout_workers(policy_path)
        self.rewarders = [RewardActor.options(**self.placement.options("reward", i, f"RewardActor-{i}")).remote(
            [s.model_dump() for s in cfg.rewards.components], cfg.rewards.timeout_s, cfg.rewards.on_error,
            cfg.cluster.reward.threads) for i in range(cfg.cluster.reward.num)]
        self.learners = LearnerGroup(cfg, self.placement, self.base_model, resume_from)
        self.learners.connect(self.workers)
        if resume_from:  # stateful rewards (ARMed's adaptive thresholds) continue where they were
            states = ckpt.read_state(resume_from).get("reward_states", [])
            ray.get([r.load_state_dict.remote(s) for r, s in zip(self.rewarders, states)])
        ray.get([w.ready.remote() for w in self.workers] + [r.__ray_ready__.remote() for r in self.rewarders])
        self.version = self.step  # the learner's weight version: one per optimizer step taken
        self.metrics = MetricsLogger(self.out, cfg.logging, resume_step=self.step if cfg.resume else None)

    def _load_tasks(self) -> list[dict]:
        tasks = load_tasks(self.cfg.data.train)
        limit = self.cfg.data.max_prompt_tokens
        kept = [t for t in tasks if len(self.tokenizer.apply_chat_template(
            t["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)) <= limit]
        if len(kept) < len(tasks):
            log.warning("dropped %d of %d tasks longer than data.max_prompt_tokens=%d", len(tasks) - len(kept),
                        len(tasks), limit)
        return kept

    def _start_rollout_workers(self, model_path: str) -> list:
        cfg, res = self.cfg, self.cfg.cluster.rollout
        return [RolloutWorker.options(**self.placement.options("rollout", i, f"RolloutWorker-{i}")).remote(
            model_path, seed=cfg.seed, threads=res.threads, dtype=cfg.model.dtype,
            max_model_len=cfg.rollout.max_model_len, kv_cache_gb=cfg.rollout.kv_cache_gb,
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization, version=self.step,
            grammar=cfg.rollout.grammar.model_dump()) for i in range(res.num)]

    # ---- one step, stage by stage ---------------------------------------------------------------------------
    def start_rollouts(self, step: int) -> StepRollouts:
        """Send step `step`'s prompts to the rollout workers, whole groups per worker."""
        r = self.cfg.rollout
        indices = self.sampler.batch(step)
        sampling = {"temperature": r.temperature, "top_p": r.top_p, "max_tokens": r.max_new_tokens, "stop": r.stop}
        step_seed = derive_seed(self.cfg.seed, step)
        chunks = np.array_split(np.arange(len(indices)), len(self.workers))
        trajs, summaries = [], []
        for worker, groups in zip(self.workers, chunks):
            t_ref, s_ref = worker.rollout.options(num_returns=2).remote(
                [self.tasks[indices[g]] for g in groups], groups.tolist(), r.group_size, sampling, step_seed)
            trajs.append(t_ref)
            summaries.append(s_ref)
        return StepRollouts(step, trajs, summaries)

    def score(self, rollouts: StepRollouts) -> list[dict]:
        """Each worker's trajectories go straight from its object to a reward actor."""
        return ray.get([self.rewarders[i % len(self.rewarders)].score.remote(ref)
                        for i, ref in enumerate(rollouts.trajectories)])

    def check_fidelity(self, rollouts: StepRollouts, n: int = 4) -> float:
        """Max |engine logprob - learner logprob| over a few of the step's sequences, under the synced weights."""
        sample = ray.get(rollouts.trajectories[0])[:n]
        seqs = [t.prompt_ids + t.response_ids for t in sample]
        learner = self.learners.sequence_logprobs(seqs)
        diffs = [np.max(np.abs(np.array(e) - np.array(l))) for w in self.workers
                 for e, l in zip(ray.get(w.prompt_logprobs.remote(seqs)), learner)]
        return float(max(diffs))

    # ---- the loop --------------------------------------------------------------------------------------------
    def fit(self) -> list[dict]:
        self.setup()
        try:
            return self.loop()
        finally:
            self.shutdown()

    def loop(self) -> list[dict]:
        cfg, history = self.cfg, []
        overlap = cfg.async_mode == "one_step_off"
        pending = self.start_rollouts(self.step) if self.step < cfg.total_steps else None
        with self.metrics.progress(cfg.total_steps, self.step) as bar:
            while pending is not None:
                step_start, rollouts = time.perf_counter(), pending
                scores = self.score(rollouts)
                summaries = ray.get(rollouts.summaries)
                # one_step_off: the next batch is sampled with the current weights while this one trains.
                next_step = rollouts.step + 1
                pending = self.start_rollouts(next_step) if overlap and next_step < cfg.total_steps else None

                totals = torch.tensor([x for s in scores for x in s["total"]])
                advantages = group_advantages(totals, cfg.rollout.group_size, cfg.algorithm.normalize_std)
                train = self.learners.train(rollouts.trajectories, advantages.tolist())
                self.version += 1
                sync = self.learners.sync(self.version)

                if not overlap and next_step < cfg.total_steps:
                    pending = self.start_rollouts(next_step)
                self.step = next_step
                record = step_metrics(self.step, scores, summaries, train, sync, self.version)
                if cfg.rollout.fidelity_check_every and self.step % cfg.rollout.fidelity_check_every == 0:
                    record["fidelity_max_abs_diff"] = self.check_fidelity(rollouts)
                    if record["fidelity_max_abs_diff"] > cfg.rollout.fidelity_tolerance:
                        raise RuntimeError(f"rollout and learner log-probabilities differ by "
                                           f"{record['fidelity_max_abs_diff']:.2e} after the sync of step "
                                           f"{self.step} (tolerance {cfg.rollout.fidelity_tolerance:g})")
                if self.step % cfg.checkpoint.every == 0 or self.step == cfg.total_steps:
                    record["checkpoint_s"] = self.save_checkpoint()
                record["step_s"] = time.perf_counter() - step_start
                self.metrics.log(record)
                bar.update(record)
                history.append(record)
        return history

    def save_checkpoint(self) -> float:
        start = time.perf_counter()
        tmp = ckpt.staging_dir(self.ckpt_root, self.step)
        self.learners.save(tmp)
        self.tokenizer.save_pretrained(tmp)
        reward_states = ray.get([r.state_dict.remote() for r in self.rewarders])
        ckpt.commit(self.ckpt_root, tmp, self.step, {"step": self.step, "version": self.version, "seed": self.cfg.seed,
                                                     "reward_states": reward_states}, self.cfg.checkpoint.keep_last)
        return time.perf_counter() - start

    def shutdown(self) -> None:
        """Release every actor and reservation, so the next run (or test) in this Ray session finds them free."""
        self.metrics.close()
        self.learners.shutdown()
        for actor in self.workers + self.rewarders:
            ray.kill(actor)
        self.placement.remove()


def step_metrics(step: int, scores: list[dict], summaries: list[dict], train: dict, sync: dict,
                 version: int) -> dict:
    """One line of metrics.jsonl: reward and its components, lengths, learner statistics and timings."""
    totals = np.array([x for s in scores for x in s["total"]])
    components: dict[str, list[float]] = {}
    errors: dict[str, int] = {}
    for s in scores:
        for k, v in s["components"].items():
            components.setdefault(k, []).extend(v)
        for k, v in s["errors"].items():
            errors[k] = errors.get(k, 0) + v
    nci: dict[str, list[float]] = {}
    for s in scores:
        for k, v in s.get("nci", {}).items():
            nci.setdefault(k, []).append(v)
    lengths = [n for s in summaries for n in s["lengths"]]
    batch_versions = [s["version"] for s in summaries]
    tokens = sum(lengths)
    mask_sum = max(train["mask_sum"], 1.0)
    record = {
        "step": step,
        "reward_mean": float(totals.mean()), "reward_std": float(totals.std()),
        **{f"reward/{k}": float(np.mean(v)) for k, v in components.items()},
        **{f"reward_errors/{k}": v for k, v in errors.items()},
        **{f"nci/{k}": float(np.mean(v)) for k, v in nci.items()},
        "response_length": float(np.mean(lengths)),
        "truncated_fraction": float(np.mean([r == "length" for s in summaries for r in s["finish_reasons"]])),
        "env_calls": sum(s["env_calls"] for s in summaries), "env_errors": sum(s["env_errors"] for s in summaries),
        "env_idle_fraction": sum(s["idle_s"] for s in summaries) / max(sum(s["seconds"] for s in summaries), 1e-9),
        "kl": train["kl_sum"] / mask_sum, "entropy": train["entropy_sum"] / mask_sum,
        "clip_fraction": train["clip_sum"] / mask_sum, "grad_norm": train["grad_norm"], "lr": train["lr"],
        "loss": train["loss"],
        "generate_s": max(s["seconds"] for s in summaries), "reward_s": max(s["seconds"] for s in scores), "train_s": train["seconds"],
        **sync,
        "tokens_per_s": tokens / max(max(s["seconds"] for s in summaries), 1e-9),
        "batch_weight_version": min(batch_versions), "weight_version": version,
        "version_lag": version - 1 - min(batch_versions),
    }
    if "accuracy" in components:
        record["accuracy"] = record["reward/accuracy"]
    return record

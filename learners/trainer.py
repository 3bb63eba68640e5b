"""The trainer loop: sample prompts -> rollouts -> rewards -> advantages -> learner update -> weight sync.

A run is a list of stages (one GRPO stage unless the config lists more): a GRPO stage runs the loop above, an SFT
stage trains on demonstrations; weights carry over from stage to stage. The driver only moves object refs and small
numbers; trajectories go from rollout workers to reward actors and learners directly through the object store.

Read top to bottom: the loop (and its fully asynchronous form), then one step's parts. Set-up and teardown are
learners/run_setup.py (the actors themselves are a `Fleet`, learners/fleet.py, which evaluation stands on too);
entering a stage is learners/stages.py; checkpoints, and the learner group's restart from one when a rank fails,
learners/recovery.py.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray
import torch

from actors.episode import derive_seed
from actors.rollout_worker import RolloutCall
from actors.trajectory import RolloutSummary
from cluster.placement import ROLES
from cluster.storage import run_storage
from learners import checkpoint as ckpt
from learners.algorithm import compute_advantages
from learners.config import RunConfig
from learners.data import PromptSampler
from learners.dynamic_sampling import count_informative, fill_batch, kept_groups
from learners.fleet import Fleet, gather_shares, send_shares
from learners.learner_group import LearnerGroup, LearnerRankFailed
from learners.learner_step import LearnerStep
from learners.memory_plan import NodeWatch
from learners.metrics import MetricsLogger, kept_metrics, kept_scores, sample_totals, step_metrics
from learners.recovery import Recovery
from learners.rollout_stream import RolloutStream
from learners.run_setup import RunSetup
from learners.services import changed_process, count_restarts, service_actors, service_roles
from learners.stages import Stages
from learners.validation import Validator, closing_report, plot_curves

log = logging.getLogger("medray.trainer")


@dataclass
class StepRollouts:
    """One step's rollouts in flight: per-worker trajectory refs and summary refs, and each worker's call (so a share
    lost with its worker can be generated again)."""
    step: int
    version: int                      # the learner weight version the workers held when the step was sent
    trajectories: list[ray.ObjectRef]
    summaries: list[ray.ObjectRef]
    calls: list[RolloutCall]


@dataclass
class TrainingBatch:
    """What a GRPO step trains on, and what its reward metrics are over."""
    trajectories: list[ray.ObjectRef]  # the batch's trajectory refs, whole groups in order
    totals: list[float]                # each sample's total reward, in the batch's order
    sampling: dict                     # dynamic sampling's stats and its kept groups' reward columns; {} without it
    sampled: list[dict]                # the score dicts of every group sampled in the step
    trained: list[dict]                # the batch's own score dicts, in its order


class Trainer(Stages, Recovery, RunSetup):
    def __init__(self, cfg: RunConfig, on_ray_start=None):
        """`on_ray_start`: called once Ray is up (learners/run.py routes the actors' output to run.log)."""
        self.cfg = cfg
        self.fleet = Fleet(cfg, ROLES + service_roles(cfg), on_ray_start=on_ray_start)
        self.out = Path(cfg.output_dir)
        self.ckpt_root = self.out / "checkpoints"
        self.storage = run_storage(cfg.storage.path, self.out)  # where checkpoints, metrics and evaluations go too
        self.node_watch = NodeWatch()
        # The run's state, set by `setup` (None until then: `shutdown` releases only what set-up started)
        self.recipe = self.tokenizer = None
        self.base_model: str | None = None              # the policy's starting weights (the config's model, built)
        self.learners: LearnerGroup | None = None
        self.metrics: MetricsLogger | None = None
        self.validator: Validator | None = None
        self.report: str | None = None                  # the closing evaluation table, once the run has one
        self.step = 0                                   # optimizer steps taken (the resumed checkpoint's at start)
        self.version = 0                                # the learner's weight version: one per optimizer step
        self.restarts = {"rollout": 0, "reward": 0, "learner": 0}  # actors restarted in the run, by role
        self.worker_pids: dict[int, int] = {}           # each rollout worker's process id, to count its restarts once
        self.reward_pids: dict[str, int] = {}           # by actor id: its process id, to notice a restart
        self.service_pids: dict = {}                    # the same for the service actors (retriever, tools, judge)
        self.history: list[dict] = []                   # each step's record
        self.startup: dict = {}                         # set-up time by phase, reported with the first step
        # The current stage's (learners/stages.py: enter_stage)
        self.stage_index: int | None = None
        self.stage = self.stage_cfg = self.sampler = None
        self.tasks: list[dict] | None = None            # a GRPO stage's prompts
        self.demonstrations: list | None = None         # an SFT stage's
        self.rollout_hooks: list = []
        self.stateful_rewards = False
        self.quiesce = contextlib.nullcontext  # fully_async: pauses the rollout stream while workers are used otherwise

    # ---- the loop --------------------------------------------------------------------------------------------
    def fit(self) -> list[dict]:
        self.setup()
        try:
            return self.loop()
        finally:
            self.shutdown()

    def loop(self) -> list[dict]:
        """Stage after stage until total_steps; each stage runs from the current step to its end. A learner rank that
        fails sends the run back to its newest checkpoint with a new learner group (learners/recovery.py). Returns
        each step's record, once."""
        if self.validator and self.cfg.eval.at_start and self.step == 0:
            self.metrics.log({"step": 0, **self.validate()})
        with self.metrics.progress(self.cfg.total_steps, self.step) as bar:
            while self.step < self.cfg.total_steps:
                index, end = self.stage_at(self.step)
                self.enter_stage(index)
                run = self.run_sft if self.stage.kind == "sft" else \
                    self.run_grpo_streamed if self.cfg.async_mode == "fully_async" else self.run_grpo
                try:
                    run(end, bar)
                except LearnerRankFailed as failure:
                    self.restart_learners(failure)
        if self.validator:
            self.report = closing_report(self.cfg, self.out)
        plot_curves(self.out, self.cfg)
        if self.storage:
            self.metrics.flush()
            ckpt.publish_run_files(self.storage, self.out)
        return self.history

    def run_grpo(self, end: int, bar) -> None:
        """GRPO steps until `end`: prompts -> rollouts -> rewards -> advantages -> update -> sync -> log. With
        one_step_off the next step's rollouts are sampled with the current weights while this step trains."""
        cfg = self.stage_cfg
        overlap = self.cfg.async_mode == "one_step_off"
        pending = self.start_rollouts(self.step)
        while pending is not None:
            step_start, rollouts = time.perf_counter(), pending
            summaries = self.collect(rollouts)
            scores = self.score(rollouts)
            next_step = rollouts.step + 1
            pending = self.start_rollouts(next_step) if overlap and next_step < end else None
            batch = self.training_batch(rollouts, scores)
            advantages = compute_advantages(torch.tensor(batch.totals), cfg.rollout.group_size,
                                            cfg.algorithm.advantage, cfg.algorithm.normalize_std)
            train, sync = self.update_and_sync(batch.trajectories, advantages.tolist(), "grpo")
            if not overlap and next_step < end:
                pending = self.start_rollouts(next_step)
            self.step = next_step
            self.metrics.traces.record(self.step, self.stage.name, batch.trajectories, batch.trained,
                                       advantages.tolist(), cfg.rollout.grammar.observation_tag)
            record = {**step_metrics(self.step, batch.sampled, summaries, train, sync, self.version),
                      **batch.sampling, **self.health(rollouts.trajectories[0])}
            self.finish_step(record, step_start, bar)

    def run_grpo_streamed(self, end: int, bar) -> None:
        """GRPO steps until `end` on fully asynchronous rollouts (learners/rollout_stream.py): each step trains on the
        next prompts_per_step groups to finish and publishes its weights, which the workers take between slices of
        generation."""
        cfg, r = self.stage_cfg, self.stage_cfg.rollout
        if self.rollout_hooks:
            raise ValueError(f"async=fully_async does not run rollout hooks (the recipe's "
                             f"{[type(h).__name__ for h in self.rollout_hooks]}): use sync or one_step_off")
        stream = RolloutStream(self.workers, self.rewarders, self.stream_call, r.prompts_per_step,
                               self.cfg.max_staleness, self.version, self.step * r.prompts_per_step,
                               self.restore_worker,
                               cfg.algorithm.max_extra_rounds * r.prompts_per_step if cfg.algorithm.dynamic_sampling
                               else 0)
        self.quiesce = stream.paused_and_current
        try:
            while self.step < end:
                step_start = time.perf_counter()
                groups, scores, filtered, stats = stream.take()
                self.note_reward_restarts(scores + filtered)
                if self.stateful_rewards:
                    scores = ray.get(self.rewarders[0].calibrate.remote(scores))
                batch = TrainingBatch([g.trajectories for g in groups], sample_totals(scores), {}, scores + filtered,
                                      scores)
                advantages = compute_advantages(torch.tensor(batch.totals), r.group_size, cfg.algorithm.advantage,
                                                cfg.algorithm.normalize_std)
                train = self.learners.train(batch.trajectories, advantages.tolist(), cfg, objective="grpo")
                self.version += 1
                published = time.perf_counter()
                manifest, sync = self.learners.publish(self.version)
                sync["sync_s"] = time.perf_counter() - published  # the learner's part: workers load between slices
                stream.trained(self.version, manifest)
                del manifest
                self.step += 1
                self.metrics.traces.record(self.step, self.stage.name, batch.trajectories, batch.trained,
                                           advantages.tolist(), r.grammar.observation_tag)
                summaries = stream.summaries(groups, stats.pop("slices"))
                record = {**step_metrics(self.step, batch.sampled, summaries, train, sync, self.version),
                          **{f"stream/{k}": v for k, v in stats.items()}, **self.health(batch.trajectories[0])}
                self.finish_step(record, step_start, bar)
        finally:
            self.quiesce = contextlib.nullcontext
            stream.close()

    def stream_call(self, groups: list[int]) -> RolloutCall:
        """The rollouts of stream groups `groups`: group n samples the prompt the sampler puts at slot
        n % prompts_per_step of step n // prompts_per_step, with seeds derived from n."""
        r = self.stage_cfg.rollout
        tasks = [self.tasks[self.sampler.batch(n // r.prompts_per_step)[n % r.prompts_per_step]] for n in groups]
        return RolloutCall(tasks, groups, r.group_size, r.sampling(), derive_seed(self.cfg.seed, "stream"),
                           r.grammar.model_dump())

    def run_sft(self, end: int, bar) -> None:
        """Demonstration batches through the same learner group; the weights reach the rollout workers each step."""
        while self.step < end:
            step_start = time.perf_counter()
            batch = [self.demonstrations[i] for i in self.sampler.batch(self.step)]
            train, sync = self.update_and_sync([ray.put(batch)], None, "sft")
            self.step += 1
            tokens = max(train.mask_sum, 1.0)
            record = {"step": self.step, "sft_loss": train.loss, "sft_tokens": train.mask_sum,
                      "entropy": train.entropy_sum / tokens, "grad_norm": train.grad_norm, "lr": train.lr,
                      "train_s": train.seconds, **sync, "weight_version": self.version, **train.reports}
            self.finish_step(record, step_start, bar)

    def finish_step(self, record: dict, step_start: float, bar) -> None:
        """Stage columns, checkpoint when due, timing; then the record goes to every metrics sink and the history."""
        record.update(stage=self.stage_index, stage_name=self.stage.name, **self.startup, **self.node_watch(record))
        self.startup = {}
        if self.step % self.cfg.checkpoint.every == 0 or self.step == self.cfg.total_steps \
                or self.step == self.stage_at(self.step - 1)[1]:
            record["checkpoint_s"] = self.save_checkpoint()
        record["step_s"] = time.perf_counter() - step_start
        if self.validator and self.validator.due(self.step):
            record.update(self.validate())
        self.metrics.log(record)
        if self.storage and "checkpoint_s" in record:  # with the checkpoint: this step's line and evaluations
            self.metrics.flush()
            ckpt.publish_run_files(self.storage, self.out)
        bar.update(record)
        self.history.append(record)

    def validate(self) -> dict:
        """The eval section's splits on the rollout workers, under the weights they hold now."""
        start = time.perf_counter()
        with self.quiesce():
            record = self.validator.run(self.workers, self.step, self.stage_cfg.rollout.grammar.model_dump(),
                                        self.judge, self.version, self.restore_worker)
        # the service actors' work during the evaluation (a judge grading answers) is not the next step's
        self.recipe.step_stats(service_actors(self.environment, self.judge))
        return {**record, "eval_s": time.perf_counter() - start}

    # ---- one step, stage by stage ---------------------------------------------------------------------------
    def start_rollouts(self, step: int, refill_round: int = 0) -> StepRollouts:
        """Send step `step`'s prompts to the rollout workers, whole groups per worker; a refill round (dynamic
        sampling) draws other prompts and seeds, still a function of (seed, step, round)."""
        r = self.stage_cfg.rollout
        sampler = self.sampler if not refill_round else PromptSampler(
            len(self.tasks), r.prompts_per_step, derive_seed(self.cfg.seed, "refill", refill_round))
        indices = sampler.batch(step)
        sampling = r.sampling()
        step_seed = derive_seed(self.cfg.seed, step, *([refill_round] if refill_round else []))
        chunks = np.array_split(np.arange(len(indices)), len(self.workers))
        calls = [RolloutCall([self.tasks[indices[g]] for g in groups], groups.tolist(), r.group_size, sampling,
                             step_seed, r.grammar.model_dump(), self.rollout_hooks) for groups in chunks]
        return StepRollouts(step, self.version, *send_shares(self.workers, calls), calls)

    def collect(self, rollouts: StepRollouts) -> list[RolloutSummary]:
        """The step's rollout summaries, once every worker's share has arrived. A share lost with its worker (killed,
        out of memory), or sampled by a worker Ray restarted with its start-up weights, is generated again with the
        same seeds once the current weights were sent to it (`gather_shares`): no step trains on a partial or stale
        group."""
        return gather_shares(self.workers, rollouts.calls, rollouts.trajectories, rollouts.summaries,
                             f"step {rollouts.step + 1}", rollouts.version, self.restore_worker)

    def restore_worker(self, i: int) -> None:
        """RolloutWorker-i, restarted by Ray with its start-up weights, gets the current ones (each restart counted
        once in actor_restarts/rollout). A restarted worker cannot rejoin a collective weight-sync group: the run
        stops."""
        if self.learners.transport == "collective":
            raise RuntimeError(f"RolloutWorker-{i} was restarted; a restarted worker cannot rejoin the collective "
                               f"weight-sync group: use cluster.weight_sync=object_store for fault tolerance")
        pid = ray.get(self.workers[i].ready.remote())["pid"]
        self.restarts["rollout"] += changed_process(self.worker_pids, i, pid)  # once, however many calls found it lost
        self.learners.sync(self.version)

    def score(self, rollouts: StepRollouts) -> list[dict]:
        """Each worker's trajectories go straight from its object to a reward actor. A reward actor that dies is
        restarted by Ray and the call retried there (RewardActor's max_task_retries); a changed process id tells
        the metrics it happened. With stateful rewards the owner then calibrates the whole batch once."""
        scores = ray.get([self.rewarders[i % len(self.rewarders)].score.remote(ref)
                          for i, ref in enumerate(rollouts.trajectories)])
        self.note_reward_restarts(scores)
        return ray.get(self.rewarders[0].calibrate.remote(scores)) if self.stateful_rewards else scores

    def note_reward_restarts(self, scores: list[dict]) -> None:
        """Counts each reward actor's restart once: its score dicts then carry another process id under the same
        actor id."""
        self.restarts["reward"] += sum(changed_process(self.reward_pids, s["actor"], s["pid"]) for s in scores)

    def training_batch(self, rollouts: StepRollouts, scores: list[dict]) -> TrainingBatch:
        """What the learner trains on: the step's rollouts with their rewards, or with dynamic sampling the
        informative groups (`refill`), always prompts_per_step whole groups."""
        r = self.stage_cfg.rollout
        batch = self.refill(rollouts, scores) if self.stage_cfg.algorithm.dynamic_sampling \
            else TrainingBatch(rollouts.trajectories, sample_totals(scores), {}, scores, scores)
        if len(batch.totals) != r.prompts_per_step * r.group_size:
            raise RuntimeError(f"step {rollouts.step + 1}: {len(batch.totals)} samples scored, expected "
                               f"{r.prompts_per_step * r.group_size}")
        return batch

    def refill(self, rollouts: StepRollouts, scores: list[dict]) -> TrainingBatch:
        """DAPO's dynamic sampling (learners/dynamic_sampling.py): rounds of other prompts while fewer than
        prompts_per_step groups have rewards that differ, then the batch of those groups, as one object. The step's
        reward metrics are over all the groups sampled, not the kept ones only; the kept groups' reward columns are
        in the sampling stats (`*_kept`)."""
        r, bound = self.stage_cfg.rollout, self.stage_cfg.algorithm.max_extra_rounds
        round_scores = [scores]
        rounds = [([t for share in ray.get(rollouts.trajectories) for t in share], sample_totals(scores))]
        while count_informative(rounds, r.group_size) < r.prompts_per_step and len(rounds) <= bound:
            extra = self.start_rollouts(rollouts.step, refill_round=len(rounds))
            self.collect(extra)
            round_scores.append(scored := self.score(extra))
            rounds.append(([t for share in ray.get(extra.trajectories) for t in share], sample_totals(scored)))
        trajectories, kept, stats = fill_batch(rounds, r.group_size, r.prompts_per_step)
        stats.update(kept_metrics(round_scores, r.group_size, r.prompts_per_step))
        picks, _ = kept_groups([totals for _, totals in rounds], r.group_size, r.prompts_per_step)
        return TrainingBatch([ray.put(trajectories)], kept, {**stats, "extra_generation_rounds": len(rounds) - 1},
                             [s for each in round_scores for s in each],
                             kept_scores(round_scores, picks, r.group_size))

    def update_and_sync(self, batch: list, advantages: list[float] | None, objective: str) -> tuple[LearnerStep, dict]:
        """The tail every step shares: one update of the learner group, then its weights to every rollout worker."""
        train = self.learners.train(batch, advantages, self.stage_cfg, objective=objective)
        self.version += 1
        sync = self.learners.sync(self.version)
        self.restarts["rollout"] += sync["sync_retries"]  # a worker lost between steps, back for the sync
        return train, sync

    def health(self, sample: ray.ObjectRef) -> dict:
        """What a GRPO step reports about the machinery around the algorithm: actors restarted, by role; the recipe
        plugin's numbers from the service actors (`step_stats`); and every fidelity_check_every steps the
        engine-vs-learner log-probability check on `sample` (trajectories), which stops the run when it fails."""
        cfg = self.stage_cfg
        services = service_actors(self.environment, self.judge)
        count_restarts(services, self.service_pids, self.restarts)
        record = {f"actor_restarts/{role}": n for role, n in self.restarts.items()}
        record.update(self.recipe.step_stats(services))
        if cfg.rollout.fidelity_check_every and self.step % cfg.rollout.fidelity_check_every == 0:
            with self.quiesce():
                record["fidelity_max_abs_diff"] = self.learners.fidelity(self.workers, sample, version=self.version,
                                                                         restore=self.restore_worker)
            if record["fidelity_max_abs_diff"] > cfg.fidelity_tolerance():
                raise RuntimeError(f"rollout and learner log-probabilities differ by "
                                   f"{record['fidelity_max_abs_diff']:.2e} after the sync of step {self.step} "
                                   f"(rollout.fidelity_tolerance {cfg.fidelity_tolerance():g})")
        return record

    # the fleet's actors, by the names the rest of the loop (and tests) reach them by
    workers = property(lambda self: self.fleet.workers)
    rewarders = property(lambda self: self.fleet.rewarders)
    environment = property(lambda self: self.fleet.environment)
    judge = property(lambda self: self.fleet.judge)
    placement = property(lambda self: self.fleet.placement)

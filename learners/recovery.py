"""Checkpoints as the trainer writes them, and its way back to one in the middle of a run (a mixin of
learners/trainer.py's Trainer, like learners/stages.py).

A learner rank that raises or dies stops its whole group (`LearnerRankFailed`, learners/learner_group.py). The trainer
then starts a new group from the newest checkpoint that verifies, found and loaded exactly as `resume=true` does, and
redoes the steps since: prompts and seeds are functions of (seed, step), so they are the same steps.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import ray
import yaml

from cluster.placement import wait_for
from learners import checkpoint as ckpt
from learners.learner_group import LearnerGroup, LearnerRankFailed
from learners.metrics import MetricsLogger

log = logging.getLogger("medray.trainer")


class Recovery:
    """Checkpoints and learner restarts over the Trainer's state (cfg, step, version, learners, fleet, metrics,
    history, restarts)."""

    def save_checkpoint(self) -> float:
        start = time.perf_counter()
        tmp = ckpt.staging_dir(self.ckpt_root, self.step)
        self.learners.save(tmp)
        self.tokenizer.save_pretrained(tmp)
        # The stage's resolved config travels with the weights: serving takes the grammar and retrieval from it.
        (tmp / ckpt.RUN_CONFIG).write_text(yaml.safe_dump(self.stage_cfg.dump(), sort_keys=False))
        # the owner's (see enter_stage); an SFT stage has no reward actors
        reward_states = [ray.get(self.rewarders[0].state_dict.remote())] if self.rewarders else []
        state = {"step": self.step, "version": self.version, "seed": self.cfg.seed, "stage": self.stage_index,
                 "reward_states": reward_states}
        # with storage, the run's files follow in finish_step, once this step's metrics line is written
        if self.storage is None:
            ckpt.commit(self.ckpt_root, tmp, self.step, state, self.cfg.checkpoint.keep_last)
        else:
            ckpt.commit_and_publish(self.storage, self.ckpt_root, tmp, self.step, state,
                                    self.cfg.checkpoint.keep_last, self.learners)
        return time.perf_counter() - start

    def restore_rewards(self, checkpoint: Path | None) -> None:
        """Stateful rewards (adaptive thresholds) continue where `checkpoint` left them, in their owner, when it was
        written in the current stage."""
        state = ckpt.read_state(checkpoint) if checkpoint else {}
        if state.get("reward_states") and state.get("stage", 0) == self.stage_index:
            ray.get(self.rewarders[0].load_state_dict.remote(state["reward_states"][0]))

    def restart_learners(self, failure: LearnerRankFailed) -> None:
        """After `failure`: a new learner group from the newest checkpoint that verifies (`ckpt.resume_point`, as
        resume=true finds it; none yet: the initial weights, step 0), its weights on every rollout worker, the stage
        entered afresh with that checkpoint's reward state, and the trainer back at its step, the metrics lines of
        later steps dropped (they are logged again when redone). Raises `failure` once
        fault_tolerance.max_learner_restarts restarts were made, or with a collective weight sync (the rollout
        workers cannot join a new group). A new group that fails to start (a rank placed on a node Ray has not yet
        declared dead) counts as another restart."""
        limit = self.cfg.fault_tolerance.max_learner_restarts
        no_restart_left = f"No learner restart left in this run: fault_tolerance.max_learner_restarts is {limit}."
        if self.restarts["learner"] >= limit:
            failure.add_note(no_restart_left)
            raise failure
        if self.learners.transport == "collective":
            failure.add_note("The learner group is restarted in-run only with cluster.weight_sync: object_store.")
            raise failure
        self.learners.shutdown()
        while True:
            self.restarts["learner"] += 1
            checkpoint, source = ckpt.resume_point(self.ckpt_root, self.storage)
            self.step = ckpt.read_state(checkpoint)["step"] if checkpoint else 0
            log.warning("LearnerWorker-%d failed during %s (%s); restarting the learner group (%d of %d) from %s",
                        failure.rank, failure.during, failure.cause, self.restarts["learner"], limit,
                        f"checkpoint {checkpoint.name}, step {self.step}" if checkpoint
                        else "the initial weights, step 0: no checkpoint yet")
            # a lost node's bundles are moved by Ray to a node with room; without one the run stops after the timeout
            wait_for(self.cfg.cluster, {"learner": self.placement.groups["learner"]},
                     self.cfg.cluster.placement_timeout_s, progress_every_s=30.0)
            try:
                self.learners = LearnerGroup(self.cfg, self.placement, self.base_model, checkpoint, source)
                break
            except LearnerRankFailed as again:  # its ranks are stopped already
                if self.restarts["learner"] >= limit:
                    again.add_note(no_restart_left)
                    raise
                failure = again
        self.learners.connect(self.workers)
        self.version = self.step
        self.stage_index = None  # entered as at start-up: reward actors in their first state, then the checkpoint's
        self.enter_stage(self.stage_at(min(self.step, self.cfg.total_steps - 1))[0])
        self.restore_rewards(checkpoint)
        self.restarts["rollout"] += self.learners.sync(self.version)["sync_retries"]
        self.metrics.close()
        self.metrics = MetricsLogger(self.out, self.cfg.logging, resume_step=self.step)
        self.history = [record for record in self.history if record["step"] <= self.step]

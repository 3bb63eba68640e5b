"""The trainer's set-up and teardown (a mixin of learners/trainer.py's Trainer, like learners/recovery.py): Ray, the
placement, the services, the rollout workers and the learner group, in that order, and their release."""
from __future__ import annotations

import logging

import ray
import yaml

from learners import checkpoint as ckpt
from learners.learner_group import LearnerGroup
from learners.metrics import Laps, MetricsLogger
from learners.services import count_restarts, service_actors
from learners.validation import Validator
from recipes import load_recipe
from tasks.tiny_models import policy_dir

log = logging.getLogger("medray.trainer")

class RunSetup:
    """Set-up and teardown over the Trainer's state (cfg, fleet, out, storage, step, ...)."""

    # ---- set-up and teardown ------------------------------------------------------------------------------
    def setup(self) -> None:
        """Start the run's actors and reservations. A set-up that fails part-way releases whatever it had started
        (`shutdown` takes a partial state), then raises."""
        try:
            self._setup()
        except BaseException:
            try:
                self.shutdown()
            except Exception:  # noqa: BLE001  the set-up's own error is the one to report
                log.exception("releasing a failed set-up")
            raise

    def _setup(self) -> None:
        cfg, laps = self.cfg, Laps()
        if not cfg.resume:
            ckpt.refuse_existing_run(self.out, self.storage)
        self.fleet.join_ray()
        laps.lap("ray")
        self.recipe = load_recipe(cfg.recipe)
        resume_from, resume_source = None, None  # resume_source: the checkpoint's URI when it comes from storage
        if cfg.resume:
            resume_from, resume_source = ckpt.resume_point(self.ckpt_root, self.storage)
            if resume_from is None:
                log.warning("resume=true but no valid checkpoint under %s; starting from step 0",
                            self.storage.uri("checkpoints") if self.storage else self.ckpt_root)
            else:
                ckpt.refuse_other_learner(resume_from, lora=cfg.learner.lora is not None)
                self.step = ckpt.read_state(resume_from)["step"]
        self.base_model = policy_dir(cfg.model)
        # on storage, every rollout worker reads the checkpoint from there (output_dir may be the driver's disk only)
        policy_path = resume_source or (str(resume_from) if resume_from else self.base_model)

        from transformers import AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(self.base_model)
        self.fleet.place()
        # written once the run is known to fit, so a refused resume leaves the previous run's config as it was
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.yaml").write_text(yaml.safe_dump(cfg.dump(), sort_keys=False))
        laps.lap("placement")
        self.fleet.start_services()
        laps.lap("services")
        self.fleet.start_workers(policy_path, version=self.step)
        self.learners = LearnerGroup(cfg, self.placement, self.base_model, resume_from, resume_source)
        laps.lap("learners")
        self.learners.connect(self.workers)
        laps.lap("connect")
        self.enter_stage(self.stage_at(min(self.step, cfg.total_steps - 1))[0])
        laps.lap("stage")
        self.restore_rewards(resume_from)
        readies = ray.get([w.ready.remote() for w in self.workers])
        self.worker_pids = {i: ready["pid"] for i, ready in enumerate(readies)}
        laps.lap("rollout_workers")
        count_restarts(service_actors(self.environment, self.judge), self.service_pids, self.restarts)  # the pids now
        self.version = self.step
        self.metrics = MetricsLogger(self.out, cfg.logging, resume_step=self.step if cfg.resume else None)
        self.validator = Validator(cfg, self.out, self.base_model) if cfg.eval else None
        self.startup = laps.total()
        log.info("start-up %s", laps)

    def shutdown(self) -> None:
        """Release every actor and reservation (`Fleet.close`), so the next run (or test) in this Ray session finds
        them free; after a set-up that failed part-way, what it had started."""
        if self.metrics is not None:
            self.metrics.close()
        if self.learners is not None:
            self.learners.shutdown()
        self.fleet.close()


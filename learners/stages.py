"""The stages of a run as the trainer moves through them (a mixin of learners/trainer.py's Trainer): which stage runs
a step, and entering one: its prompts or demonstrations, and reward actors for its reward spec.
"""
from __future__ import annotations

import logging

import ray

from actors.episode import derive_seed
from actors.image_tokens import ImageTokens
from learners.config import RunConfig
from learners.data import PromptSampler, demonstration_trajectory, prompts_that_fit, read_demonstrations

log = logging.getLogger("medray.trainer")


class Stages:
    """Stage handling over the Trainer's state (cfg, recipe, tokenizer, fleet, step, out)."""

    def stage_at(self, step: int) -> tuple[int, int]:
        """(index of the stage that runs step `step` + 1, the global step at which that stage ends)."""
        end = 0
        for index, stage in enumerate(self.cfg.stage_plan()):
            end += stage.steps
            if step < end:
                return index, end
        raise ValueError(f"step {step} is past the run's {self.cfg.total_steps} steps")

    def enter_stage(self, index: int) -> None:
        """Make stage `index` current: its prompts or demonstrations, and reward actors for its reward spec (weights,
        rollout workers and the environment carry over)."""
        if index == self.stage_index:
            return
        previous = self.stage_cfg if self.stage_index is not None else None
        self.stage_index, self.stage = index, self.cfg.stage_plan()[index]
        self.stage_cfg = cfg = self.cfg.for_stage(index)
        log.info("stage %d (%s, %s): %d steps", index, self.stage.name, self.stage.kind, self.stage.steps)
        if self.stage.kind == "sft":
            sft = self.stage.sft
            demos = self.generated_demonstrations(cfg) if sft.data == "expert" or \
                sft.data in self.recipe.demonstration_sources else read_demonstrations(sft.data)
            vision = ImageTokens.for_model(self.base_model)
            self.demonstrations = [demonstration_trajectory(d, self.tokenizer, i, vision) for i, d in enumerate(demos)]
            self.sampler = PromptSampler(len(demos), sft.batch_size, cfg.seed, sft.shuffle)
            return
        if previous is None or previous.data != cfg.data or self.tasks is None:
            self.tasks = prompts_that_fit(cfg.data, self.tokenizer)
        self.sampler = PromptSampler(len(self.tasks), cfg.rollout.prompts_per_step, cfg.seed, cfg.data.shuffle)
        self.rollout_hooks = self.recipe.rollout_hooks(cfg)
        if previous is None or previous.rewards != cfg.rewards or not self.rewarders:
            self.fleet.start_rewarders(cfg)
            self.reward_pids = {}
            # RewardActor-0 owns the state of stateful rewards: it calibrates the whole batch once
            self.stateful_rewards = ray.get(self.rewarders[0].stateful.remote())

    def generated_demonstrations(self, cfg: RunConfig) -> list[dict]:
        """An SFT stage's generated data, made once and kept under output_dir/stages/<stage>/ so a run resumed inside
        the stage trains on the same data: the scripted expert's episodes on data.train ('expert', the cold start),
        or the recipe plugin's demonstrations (a source it names, e.g. made from the current policy's rollouts)."""
        path = self.out / "stages" / self.stage.name / "demonstrations.jsonl"
        if not path.exists() and self.stage.sft.data == "expert":
            from learners.expert import write_demonstrations
            made = write_demonstrations(cfg, cfg.data.train, path, progress=False,
                                        recheck=self.stage.sft.expert_recheck,
                                        unlinked=self.stage.sft.expert_unlinked)
            log.info("stage %s: %d expert demonstrations from %d tasks (%d without the gold document in view)",
                     self.stage.name, made["demonstrations"], made["tasks"], made["skipped_not_retrieved"])
        elif not path.exists():
            self.recipe.write_demonstrations(self.stage.sft.data, workers=self.workers,
                                             tasks=prompts_that_fit(cfg.data, self.tokenizer),
                                             tokenizer=self.tokenizer, cfg=cfg, sft=self.stage.sft,
                                             seed=derive_seed(cfg.seed, "inject", self.step), path=path)
        return read_demonstrations(path)

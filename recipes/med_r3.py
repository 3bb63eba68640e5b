"""Med-R3's plugin (the Med-R3 paper): the LLM judge's own counters in every GRPO step's metrics.

Med-R3's rewards (rewards/judge.py) ask the run's JudgeActor (the `judge` section) to score answers, extract
knowledge-graph triples and grade evidence; a judgement that cannot be parsed is retried and then scores 0. The
counters make that visible per step: judge/calls, judge/prompts, judge/retries, judge/parse_failures. The three
progressive stages are the config's `stages:` entries with their own reward specs.

    recipe: med_r3
"""
from __future__ import annotations

import ray

from recipes import Recipe, register_recipe

COUNTERS = ("calls", "prompts", "retries", "parse_failures")


@register_recipe("med_r3")
class MedR3(Recipe):
    def __init__(self, args=None):
        super().__init__(args)
        self.seen: dict[str, int] = {}  # the judge's counters at the previous step

    def check(self, cfg) -> None:
        if cfg.judge is None:
            raise ValueError("recipe med_r3 needs a judge section: its rewards ask the JudgeActor")

    def step_stats(self, services: dict[str, list]) -> dict[str, float]:
        """Each counter's increase since the previous step (0 after a judge restart reset them)."""
        judge = services.get("judge")
        if not judge:
            return {}
        counts = ray.get(judge[0].stats.remote())
        stats = {f"judge/{k}": max(0, counts[k] - self.seen.get(k, 0)) for k in COUNTERS}
        self.seen = counts
        return stats

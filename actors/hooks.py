"""The rollout seam: recipe code that runs inside a RolloutWorker's `rollout` call.

A recipe plugin (recipes/) hands the trainer a list of `RolloutHook`s per stage; they travel with every rollout call
to the workers (pickled with their settings) and act at three points:

1. before sampling: `base_samples` says how many of each group's samples are generated first, and `top_logprobs`
   asks the engine to record each policy token's entropy;
2. `extend`: after the first samples, append the rest of each group (forks of the first ones, fresh samples); the
   worker runs what was appended;
3. `finish`: read or annotate the finished trajectories (extra forward passes on the engine).

`extend` and `finish` return numbers that the step's metrics sum over workers under their own names (name them
`<recipe>/<what>`). Every default does nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from actors.episode import Episode
from actors.trajectory import Trajectory


@dataclass
class RolloutBatch:
    """One rollout call as `RolloutHook.extend` sees it."""
    groups: list[list[Episode]]            # per task, its episodes so far; extended in place, each to group_size
    prompt_images: list[int]               # how many images each task's prompt holds
    group_size: int
    seed: int                              # the call's seed: derive every random choice from it
    new_episode: Callable[[int, int], Episode]  # (task index, sample index) -> a fresh episode of that task


class RolloutHook:
    """Recipe code inside the rollout worker; see the module docstring. `worker` is the RolloutWorker itself
    (its `tokenizer`, `vision`, `runner.grammar` and `prompt_logprobs`)."""
    top_logprobs: int = 0  # > 0: record each policy token's entropy (Episode.entropies) from this many

    def base_samples(self, group_size: int) -> int:
        """How many samples of each group are generated before `extend`."""
        return group_size

    def extend(self, worker, batch: RolloutBatch) -> tuple[list[Episode], dict[str, float]]:
        """Append each group's remaining samples in place; returns the new episodes (the worker runs them) and
        numbers for the step's metrics."""
        return [], {}

    def finish(self, worker, trajectories: list[Trajectory]) -> dict[str, float]:
        """Read or annotate the finished trajectories; returns numbers for the step's metrics."""
        return {}

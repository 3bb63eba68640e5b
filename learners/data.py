"""Prompts for training: task records from JSONL, and a deterministic, resumable order over them."""
from __future__ import annotations

from pathlib import Path

import numpy as np

BUILTIN_PREFIX = "hpo:"


def resolve_tasks_path(spec: str) -> Path:
    """A JSONL path, or `hpo:<split>` (e.g. hpo:mcq_train) for the built-in HPO tasks, built once and cached."""
    if spec.startswith(BUILTIN_PREFIX):
        from tasks.build_hpo import ensure_hpo_world
        from tasks.hpo import cache_dir
        paths = ensure_hpo_world(cache_dir() / "hpo_world", seed=0)
        split = spec[len(BUILTIN_PREFIX):]
        if split not in paths:
            raise ValueError(f"data.train: unknown built-in split {split!r}; choose from {sorted(paths)}")
        return Path(paths[split])
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"data.train: {path} does not exist")
    return path


def load_tasks(spec: str) -> list[dict]:
    """Task records as plain dicts (they travel to actors); malformed lines raise naming file and line."""
    from tasks.schema import read_tasks
    return [t.model_dump(mode="json") for t in read_tasks(resolve_tasks_path(spec))]


class PromptSampler:
    """Epoch-wise shuffled order; the batch of step s depends only on (seed, s), so resuming needs only s."""

    def __init__(self, num_tasks: int, batch_size: int, seed: int, shuffle: bool = True):
        if num_tasks < 1:
            raise ValueError("the training set is empty")
        self.n, self.batch_size, self.seed, self.shuffle = num_tasks, batch_size, seed, shuffle
        self._orders: dict[int, np.ndarray] = {}

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n)
                            if self.shuffle else np.arange(self.n)}
        return self._orders[epoch]

    def batch(self, step: int) -> list[int]:
        start = step * self.batch_size
        indices = []
        for position in range(start, start + self.batch_size):
            epoch, offset = divmod(position, self.n)
            indices.append(int(self._epoch_order(epoch)[offset]))
        return indices

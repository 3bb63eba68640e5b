"""Prompts for training: task records from JSONL, and a deterministic, resumable order over them."""
from __future__ import annotations

from pathlib import Path

import numpy as np

def _builtin_worlds() -> dict:
    """The medical worlds medray builds itself, by prefix: each returns {split name: path}, building once."""
    from tasks.build_hpo import ensure_hpo_world
    from tasks.build_imaging import ensure_imaging_world
    from tasks.hpo import cache_dir
    return {"hpo": lambda: ensure_hpo_world(cache_dir() / "hpo_world", seed=0),
            "imaging": lambda: ensure_imaging_world(progress=False)}


def resolve_tasks_path(spec: str) -> Path:
    """A JSONL path, or `<world>:<split>` for a built-in world (hpo:mcq_train, imaging:finding_mcq_train, ...)."""
    world, _, split = spec.partition(":")
    worlds = _builtin_worlds() if split else {}
    if world in worlds:
        paths = worlds[world]()
        if split not in paths:
            raise ValueError(f"data.train: unknown {world} split {split!r}; choose from {sorted(paths)}")
        return Path(paths[split])
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"data.train: {path} does not exist")
    return path


def load_tasks(spec: str) -> list[dict]:
    """Task records as plain dicts (they travel to actors); malformed lines raise naming file and line.
    Relative image paths are resolved against the task file's directory."""
    from tasks.schema import read_tasks, resolve_image_paths
    path = resolve_tasks_path(spec)
    return [resolve_image_paths(t, path.parent).model_dump(mode="json") for t in read_tasks(path)]


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

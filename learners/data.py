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
    Relative image paths are resolved against the task file's directory, and every image must exist (checked here,
    so a wrong path fails before any actor starts, naming the file, the task and the field)."""
    from tasks.schema import TaskFormatError, read_tasks, resolve_image_paths
    path = resolve_tasks_path(spec)
    tasks = [resolve_image_paths(t, path.parent) for t in read_tasks(path)]
    if not tasks:
        raise TaskFormatError(f"{path}: no tasks (the file has no non-blank lines)")
    for task in tasks:
        for i, image in enumerate(task.images):
            if not Path(image).is_file():
                raise TaskFormatError(f"{path}: task {task.id!r}: field 'images.{i}': image not found: {image}")
    return [t.model_dump(mode="json") for t in tasks]


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


def read_demonstrations(path: str | Path) -> list[dict]:
    """SFT demonstrations, one JSON object per line: {"task": {..., "messages": [...]}, "segments": [{"role":
    "policy" | "environment", "text": str}, ...]}. A malformed line raises naming file, line and field."""
    from tasks.schema import TaskFormatError, jsonl_objects
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"sft.data: {path} does not exist (python -m tasks.expert writes demonstrations)")
    demos = []
    for where, _, row in jsonl_objects(path):
        problem = _demonstration_problem(row)
        if problem:
            raise TaskFormatError(f"{where}: {problem}")
        demos.append(row)
    if not demos:
        raise TaskFormatError(f"{path}: no demonstrations")
    return demos


def _demonstration_problem(row: dict) -> str | None:
    task = row.get("task")
    if not isinstance(task, dict) or not isinstance(task.get("messages"), list) or not task["messages"]:
        return "field 'task.messages': a non-empty list of chat messages is required"
    segments = row.get("segments")
    if not isinstance(segments, list) or not segments:
        return "field 'segments': a non-empty list is required"
    for i, seg in enumerate(segments):
        if not isinstance(seg, dict) or seg.get("role") not in ("policy", "environment") \
                or not isinstance(seg.get("text"), str):
            return f"field 'segments.{i}': needs role 'policy' or 'environment' and a text string"
    if not any(seg["role"] == "policy" for seg in segments):
        return "field 'segments': no policy segment, nothing to learn"
    return None


def demonstration_trajectory(demo: dict, tokenizer, group: int, vision=None):
    """A demonstration as a Trajectory the learner trains on: the chat prompt (with the task's images for a
    multimodal policy, `vision` an `actors.environment.ImageTokens`), then each segment tokenised on its own (as the
    rollout engine appends the environment's observations; a segment's `images` fill its image placeholders), loss
    mask 1 on policy segments only."""
    from PIL import Image

    from actors.environment import rgb_array
    from actors.rollout_worker import task_prompt
    from actors.trajectory import Trajectory
    task = demo["task"]
    if vision is None:
        task = {**task, "images": []}  # a text-only policy reads the question alone, as in its rollouts
    prompt, images, grids = task_prompt(task, tokenizer, vision)
    ids, mask = [], []
    for seg in demo["segments"]:
        tokens = tokenizer.encode(seg["text"], add_special_tokens=False)
        if seg.get("images") and vision is not None:
            shown = []
            for path in seg["images"]:
                with Image.open(path) as image:
                    shown.append(rgb_array(image))
            seg_grids = [vision.grid(im) for im in shown]
            tokens = vision.expand(tokens, seg_grids)
            images, grids = images + shown, grids + seg_grids
        ids += tokens
        mask += [int(seg["role"] == "policy")] * len(tokens)
    return Trajectory(task=demo["task"], group=group, prompt_ids=list(prompt), response_ids=ids,
                      logprobs=[0.0] * len(ids), loss_mask=mask, text="".join(s["text"] for s in demo["segments"]),
                      finish_reason="demonstration", weight_version=-1, images=images, image_grids=grids)

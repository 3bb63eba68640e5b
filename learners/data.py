"""Prompts for training: task records from JSONL, and a deterministic, resumable order over them."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from tasks.catalog import load_tasks, resolve_tasks_path  # noqa: F401  (the trainer's data API)

log = logging.getLogger("medray.data")


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


def prompts_that_fit(data, tokenizer) -> list[dict]:
    """data.train's tasks whose chat prompt is at most data.max_prompt_tokens tokens (the others dropped, counted in
    a warning)."""
    tasks = load_tasks(data.train)
    kept = [t for t in tasks if len(tokenizer.apply_chat_template(
        t["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)) <= data.max_prompt_tokens]
    if len(kept) < len(tasks):
        log.warning("dropped %d of %d tasks longer than data.max_prompt_tokens=%d", len(tasks) - len(kept),
                    len(tasks), data.max_prompt_tokens)
    return kept


def read_demonstrations(path: str | Path) -> list[dict]:
    """SFT demonstrations, one JSON object per line: {"task": {..., "messages": [...]}, "segments": [{"role":
    "policy" | "environment", "text": str}, ...]}. A malformed line raises naming file, line and field."""
    from tasks.schema import TaskFormatError, jsonl_objects
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"sft.data: {path} does not exist (python -m learners.expert writes demonstrations)")
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
    multimodal policy, `vision` an `actors.image_tokens.ImageTokens`), then each segment tokenised on its own (as the
    rollout engine appends the environment's observations; a segment's `images` fill its image placeholders), loss
    mask 1 on policy segments only."""
    from PIL import Image

    from actors.episode import rgb_array
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

"""The one task record every medray task and benchmark is mapped onto, and its JSONL reader/writer.

The trainer reads tasks with :func:`read_tasks`, so this module depends on the standard library and pydantic only.
Records are validated strictly (no type coercion, no unknown fields): a malformed line is an error naming the file,
the line and the field, never a silently skipped row.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class Message(BaseModel):
    """One chat turn."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    role: Literal["system", "user", "assistant"]
    content: str


class Task(BaseModel):
    """A task: the prompt (``messages``), the gold ``answer`` and what scoring and tools need.

    - ``options``: option letter -> text for multiple choice (``answer`` is then a letter), None for open-ended.
    - ``images``: image paths, in the order the messages refer to them.
    - ``gold_boxes``: ``[x0, y0, x1, y1]`` pixel boxes in the first image's full resolution (tool rewards, IoU).
    - ``references``: acceptable answer texts for text-similarity scoring (BLEU/ROUGE/BERTScore) or retrieval grounding.
    - ``metadata``: free-form provenance and difficulty strata (JSON-serialisable).
    """

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    id: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    answer: str
    options: dict[str, str] | None
    images: list[str]
    gold_boxes: list[list[float]]
    references: list[str]
    metadata: dict[str, Any]

    @model_validator(mode="after")
    def _consistent(self) -> Task:
        if self.options is not None and self.answer not in self.options:
            raise ValueError(f"field 'answer': {self.answer!r} is not one of the option keys {sorted(self.options)}")
        for box in self.gold_boxes:
            if len(box) != 4 or box[0] >= box[2] or box[1] >= box[3]:
                raise ValueError(f"field 'gold_boxes': {box} is not [x0, y0, x1, y1] with x0 < x1 and y0 < y1")
        return self


def option_listing(options: dict[str, str]) -> str:
    """A multiple-choice question's options as every task shows them: one "A. text" line per option."""
    return "\n".join(f"{letter}. {text}" for letter, text in options.items())


def parse_option_listing(text: str) -> dict[str, str]:
    """The options of the last `option_listing` block in `text` ({} when there is none): consecutive lines
    "A. text", "B. text", ... with letters in order from A, at least two."""
    runs, run = [], {}
    for line in text.splitlines():
        match = re.fullmatch(r"\s*([A-Z])\.\s+(.+?)\s*", line)
        if match and ord(match[1]) - ord("A") == len(run):
            run[match[1]] = match[2]
            continue
        if len(run) >= 2:
            runs.append(run)
        run = {"A": match[2]} if match and match[1] == "A" else {}
    if len(run) >= 2:
        runs.append(run)
    return runs[-1] if runs else {}


def chat_prompt_ids(tokenizer, messages: list[dict], num_images: int = 0) -> list[int]:
    """The chat template's ids; `num_images` placeholders (one pad each) open the first user message, where task
    images attach (the images of a Task)."""
    if num_images:
        first = next(i for i, m in enumerate(messages) if m["role"] == "user")
        parts = [{"type": "image"}] * num_images + [{"type": "text", "text": messages[first]["content"]}]
        messages = [*messages[:first], {**messages[first], "content": parts}, *messages[first + 1:]]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


class TaskFormatError(ValueError):
    """A task file line that is not a valid :class:`Task`; the message names file, line and field."""


def jsonl_objects(path: str | Path) -> Iterator[tuple[str, int, dict]]:
    """(where, line number, object) for each non-blank line of a JSONL file, `where` being "<path>:<line>"; a line
    that is not UTF-8, not JSON or not an object raises :class:`TaskFormatError` naming it."""
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TaskFormatError(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskFormatError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(data, dict):
                raise TaskFormatError(f"{where}: expected a JSON object, got {type(data).__name__}")
            yield where, lineno, data


def read_tasks(path: str | Path) -> list[Task]:
    """Read a JSONL task file (blank lines allowed); raise :class:`TaskFormatError` on the first malformed line."""
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    for where, lineno, data in jsonl_objects(Path(path)):
        try:
            task = Task.model_validate(data)
        except ValidationError as e:
            raise TaskFormatError(f"{where}: {_describe(e)}") from None
        if task.id in seen:
            raise TaskFormatError(f"{where}: field 'id': duplicate id {task.id!r} (first on line {seen[task.id]})")
        seen[task.id] = lineno
        tasks.append(task)
    return tasks


def resolve_image_paths(task: Task, base_dir: str | Path) -> Task:
    """The task with relative image paths made absolute against ``base_dir`` (the task file's directory)."""
    base = Path(base_dir)
    images = [p if Path(p).is_absolute() else str((base / p).resolve()) for p in task.images]
    return task.model_copy(update={"images": images})


def write_tasks(path: str | Path, tasks: Iterable[Task]) -> int:
    """Write tasks as JSONL (one compact object a line, keys in schema order); return how many were written."""
    from cluster.files import write_jsonl
    return write_jsonl(path, (task.model_dump(mode="json") for task in tasks))


def _describe(error: ValidationError) -> str:
    """pydantic's first error as "field 'messages.0.role': <message>" (how many more there are, if any)."""
    first = error.errors()[0]
    more = f" (and {error.error_count() - 1} more errors)" if error.error_count() > 1 else ""
    if first["loc"]:
        return f"field '{'.'.join(str(p) for p in first['loc'])}': {first['msg']}{more}"
    return first["msg"].removeprefix("Value error, ") + more  # cross-field checks name their field themselves

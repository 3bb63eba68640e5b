"""What every benchmark loader shares: the task builders, field checks with row-level errors, the file readers
and the loop that maps rows to tasks."""
from __future__ import annotations

import csv
import io
import json
import os
import pickle
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tasks.schema import _describe, Message, option_listing, Task


LETTERS = "ABCDEFGHIJ"
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
_ANSWER_KINDS = {
    "letter": "the option letter",
    "yes_no": "yes or no",
    "short": "a short answer (a word or a phrase)",
}


def vqa_system_message(answer_kind: str) -> Message:
    """The HPO world's system prompt (think / query / answer tags) for a question about the attached image(s)."""
    from tasks.hpo_tasks import SYSTEM_PROMPT

    text = "The question refers to the attached image(s). " + SYSTEM_PROMPT.format(what=_ANSWER_KINDS[answer_kind])
    return Message(role="system", content=text)


class BenchmarkFormatError(ValueError):
    """A benchmark file or row that does not fit its published layout; the message names file, row and field."""


class RowError(Exception):
    """Raised by row mappers; the loader adds file and row to make a :class:`BenchmarkFormatError`."""

    def __init__(self, field_name: str, problem: str):
        super().__init__(f"field '{field_name}': {problem}")
        self.field = field_name


@dataclass
class LoadResult:
    """Tasks read from a benchmark, plus the rows left out on request (never silently)."""

    benchmark: str
    source: str
    tasks: list[Task]
    rows: int = 0  # rows read
    skipped: int = 0  # malformed rows skipped because skip_bad=True
    errors: list[str] = field(default_factory=list)  # why each skipped row was skipped
    filtered: int = 0  # rows left out by a filter the caller asked for

    def summary(self) -> str:
        parts = [f"{self.benchmark}: {len(self.tasks)} tasks from {self.rows} rows of {self.source}"]
        if self.filtered:
            parts.append(f"{self.filtered} left out by the requested filter")
        if self.skipped:
            parts.append(f"{self.skipped} malformed rows skipped (skip_bad=True); first: {self.errors[0]}")
        return "; ".join(parts)


@dataclass
class _Context:
    """What a row mapper needs besides the row."""

    benchmark: str
    source: Path
    image_root: Path | None
    verify_images: bool
    layout: str = "published"  # or "hf" (a datasets folder)
    options: dict = field(default_factory=dict)  # loader options (split, languages, ...)


class _Filtered(Exception):
    """A row left out by a filter the caller asked for."""


# ---- field helpers -----------------------------------------------------------------------------------------------


def _get(row: dict, name: str, *, optional: bool = False) -> Any:
    if name not in row or row[name] is None:
        if optional:
            return None
        raise RowError(name, "missing")
    return row[name]


def _text(row: dict, name: str, *, optional: bool = False, number_ok: bool = False) -> str | None:
    """A non-empty string field (stripped). ``number_ok``: the published file stores some values as numbers."""
    value = _get(row, name, optional=optional)
    if value is None:
        return None
    if number_ok and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
    if not isinstance(value, str):
        raise RowError(name, f"expected a string, got {type(value).__name__} {value!r}")
    if not value.strip():
        if optional:
            return None
        raise RowError(name, "empty")
    return value.strip()


def _ident(row: dict, name: str, *, optional: bool = False) -> str | None:
    """An id field: a non-empty string or an integer."""
    value = _get(row, name, optional=optional)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)) or (isinstance(value, str) and not value.strip()):
        raise RowError(name, f"expected a non-empty string or integer id, got {value!r}")
    return str(value).strip()


def _image(ctx: _Context, name: str, value: str | list[str], *, try_extensions: bool = False) -> str:
    """Resolve an image path (or the first of several candidate paths that exists) against the image root; it must
    exist (and open, with verify_images). ``try_extensions``: a name without suffix may be .jpg, .jpeg or .png."""
    tried: list[Path] = []
    for candidate in [value] if isinstance(value, str) else value:
        path = Path(candidate)
        if not path.is_absolute():
            if ctx.image_root is None:
                raise RowError(name, f"relative image path {candidate!r} but no image root was given")
            path = ctx.image_root / path
        options = [path]
        if try_extensions and not path.suffix:
            options += [path.with_name(path.name + ext) for ext in IMAGE_EXTENSIONS]
        tried += options
        for option in options:
            if option.is_file():
                if ctx.verify_images:
                    _verify_image(option, name)
                return os.path.abspath(option)
    raise RowError(name, "image not found: " + " or ".join(str(p) for p in tried))


def _verify_image(path: Path, name: str) -> None:
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.verify()
    except Exception as e:  # noqa: BLE001 - PIL raises many kinds
        raise RowError(name, f"not a readable image: {path} ({type(e).__name__}: {e})") from None


def _open_task(ctx, task_id, question, answer, images, meta, closed: bool) -> Task:
    kind = "yes_no" if answer.lower() in ("yes", "no") else "short"
    return Task(
        id=task_id,
        messages=[vqa_system_message(kind), Message(role="user", content=question)],
        answer=answer,
        options=None,
        images=images,
        gold_boxes=[],
        references=[answer],
        metadata={"benchmark": ctx.benchmark, "answer_type": "closed" if closed else "open", **meta},
    )


def _mcq_task(ctx, task_id, question, options, letter, images, meta, list_options: bool = True) -> Task:
    content = f"{question}\n{option_listing(options)}" if list_options else question
    return Task(
        id=task_id,
        messages=[vqa_system_message("letter"), Message(role="user", content=content)],
        answer=letter,
        options=options,
        images=images,
        gold_boxes=[],
        references=[options[letter]],
        metadata={"benchmark": ctx.benchmark, "answer_type": "multiple_choice", **meta},
    )


# ---- row mappers -------------------------------------------------------------------------------------------------


# ---- row sources -------------------------------------------------------------------------------------------------

Rows = Iterator[tuple[str, int, Any]]  # (where, index, row)


def _json_array_rows(path: Path) -> Rows:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except json.JSONDecodeError as e:
        raise BenchmarkFormatError(f"{path}: invalid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise BenchmarkFormatError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if not isinstance(data, list):
        raise BenchmarkFormatError(f"{path}: expected a JSON array of objects, got a {type(data).__name__}")
    for i, row in enumerate(data):
        yield f"{path}, item {i}", i, row


def _jsonl_rows(path: Path) -> Rows:
    with open(path, "rb") as fh:
        index = 0
        for lineno, raw in enumerate(fh, start=1):
            where = f"{path}, line {lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise BenchmarkFormatError(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                yield where, index, _BadRow(f"invalid JSON ({e.msg} at column {e.colno})")
            else:
                yield where, index, row
            index += 1


def _csv_rows(path: Path, required: Iterable[str], alternatives: Iterable[tuple[str, ...]] = ()) -> Rows:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise BenchmarkFormatError(f"{path}, line {line}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    with io.StringIO(text, newline="") as fh:
        reader = csv.DictReader(fh)
        header = reader.fieldnames or []
        missing = [c for c in required if c not in header]
        missing += [" or ".join(alt) for alt in alternatives if not any(c in header for c in alt)]
        if missing:
            raise BenchmarkFormatError(
                f"{path}: header: field {missing[0]!r}: column missing (header has {header})"
            )
        for i, row in enumerate(reader):
            if None in row:  # more cells than header columns
                yield f"{path}, line {reader.line_num}", i, _BadRow(f"{len(header) + len(row[None])} cells for "
                                                                    f"{len(header)} header columns")
            else:
                yield f"{path}, line {reader.line_num}", i, {k: v for k, v in row.items()}


class _SafeUnpickler(pickle.Unpickler):
    """Plain data only (dicts, lists, strings, numbers): any class reference is refused."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: benchmark pickles hold plain data only")


def _pickle_rows(path: Path) -> Rows:
    try:
        with open(path, "rb") as fh:
            data = _SafeUnpickler(fh).load()
    except (pickle.UnpicklingError, EOFError, ValueError) as e:
        raise BenchmarkFormatError(f"{path}: not a plain-data pickle ({e})") from None
    if not isinstance(data, list):
        raise BenchmarkFormatError(f"{path}: expected a pickled list of dicts, got a {type(data).__name__}")
    for i, row in enumerate(data):
        yield f"{path}, row {i}", i, row


class _BadRow:
    """A row that could not even be parsed; mapping it raises with this message."""

    def __init__(self, message: str):
        self.message = message


# ---- driver ------------------------------------------------------------------------------------------------------


def _run(ctx: _Context, rows: Rows, mapper: Callable, skip_bad: bool, result: LoadResult) -> None:
    seen: dict[str, str] = {t.id: "an earlier file" for t in result.tasks}
    for where, index, row in rows:
        result.rows += 1
        try:
            if isinstance(row, _BadRow):
                raise BenchmarkFormatError(f"{where}: {row.message}")
            if not isinstance(row, dict):
                raise BenchmarkFormatError(f"{where}: expected an object, got {type(row).__name__}")
            try:
                task = mapper(row, ctx, index)
            except _Filtered:
                result.filtered += 1
                continue
            except RowError as e:
                raise BenchmarkFormatError(f"{where}: {e}") from None
            except ValidationError as e:
                raise BenchmarkFormatError(f"{where}: the task it maps to is invalid: {_describe(e)}") from None
            if task.id in seen:
                id_field = {"vqa_rad": "qid", "slake": "qid", "medxpertqa": "id", "omnimedvqa": "question_id",
                            "pmc_vqa": "index", "path_vqa": "question_id"}[ctx.benchmark]
                raise BenchmarkFormatError(f"{where}: field '{id_field}': duplicate id {task.id!r} "
                                           f"(first at {seen[task.id]})")
            seen[task.id] = where
            result.tasks.append(task)
        except BenchmarkFormatError as e:
            if not skip_bad:
                raise
            result.skipped += 1
            result.errors.append(str(e))


def _start(benchmark: str, path, image_root, verify_images: bool, options: dict | None = None):
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{benchmark}: {path} does not exist")
    root = Path(image_root) if image_root is not None else None
    ctx = _Context(benchmark, path, root, verify_images, options=options or {})
    return path, ctx, LoadResult(benchmark, str(path), [])


def _default_root(path: Path, *candidates: Path) -> Path:
    """The first existing candidate image folder, else the first one (errors then name the path tried)."""
    for c in candidates:
        if c.is_dir():
            return c
    return candidates[0]

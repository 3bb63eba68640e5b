"""Loaders that map medical VQA benchmarks a user has on disk onto medray's :class:`~tasks.schema.Task` schema.

Supported, each in its published layout (the field names each loader assumes are in its mapper's docstring):

- ``vqa_rad``: ``VQA_RAD Dataset Public.json`` (a JSON array); images in ``VQA_RAD Image Folder`` beside it.
- ``slake``: ``Slake1.0/{train,validate,test}.json`` (JSON arrays); images under ``Slake1.0/imgs``.
- ``path_vqa``: ``pvqa/qas/<split>/<split>_qa.pkl`` (a pickled list of dicts; plain data only) or the same rows as
  JSON / JSONL; images ``pvqa/images/<split>/<name>.jpg``.
- ``pmc_vqa``: ``train.csv`` / ``test.csv`` / ``test_clean.csv`` (v1) or ``train_2.csv`` / ``test_2.csv`` (v2);
  images in ``images`` (else ``figures``) beside the CSV.
- ``medxpertqa``: ``MM/{dev,test}.jsonl`` and ``Text/{dev,test}.jsonl``; images in ``images`` beside ``MM``.
- ``omnimedvqa``: ``QA_information/{Open,Restricted}-access/<dataset>.json`` (a file or a folder of them); image
  paths relative to the OmniMedVQA root (the folder holding ``QA_information``).
- a Hugging Face ``datasets`` folder written by ``save_to_disk`` (:func:`load_hf_saved`), whose rows follow one of
  the layouts above or, for VQA-RAD and PathVQA, the HF exports' ``image`` / ``question`` / ``answer``: embedded
  image bytes are written once to an image folder, image paths resolve against ``image_root``.

Rules, for every loader:

- Image paths are resolved against ``image_root`` (relative ones; absolute ones are kept) and must name an existing
  file; ``verify_images=True`` also opens each with PIL. Task records carry absolute image paths.
- A malformed row (a missing or mistyped field, an answer that is not one of the options, a missing image, a duplicate
  id) raises :class:`BenchmarkFormatError` naming the file, the row (``item i`` of a JSON array, counting from 0;
  ``line n`` of a JSONL or CSV file; ``row i`` of a pickle or a ``datasets`` split) and the field. Nothing is
  dropped silently: with ``skip_bad=True`` such rows are skipped instead, and :class:`LoadResult` reports how many
  (``skipped``) and why (``errors``). A file that is not in the expected layout at all (not a JSON array, a CSV
  without the expected columns) is always an error.
- Rows left out by a filter the caller asked for (``split=`` for VQA-RAD, ``languages=`` for SLAKE) are counted in
  ``LoadResult.filtered``.
- Multiple-choice rows become ``options`` (letter -> text) with a letter ``answer``; open-ended rows have
  ``options=None`` and the answer text as ``answer`` and ``references``. The prompt uses the HPO world's tag grammar
  (think / query / answer). ``metadata`` keeps the benchmark, source file, row and the row's own annotations.

``python -m tasks.loaders BENCHMARK PATH --out tasks.jsonl`` converts a benchmark into a task file.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import os
import pickle
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tasks.extras import require
from tasks.schema import Message, Task, _describe, write_tasks

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


def _listing(options: dict[str, str]) -> str:
    return "\n".join(f"{letter}. {text}" for letter, text in options.items())


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
    content = f"{question}\n{_listing(options)}" if list_options else question
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


def _map_vqa_rad(row: dict, ctx: _Context, index: int) -> Task:
    """VQA-RAD (Lau et al. 2018, OSF project 89kps), ``VQA_RAD Dataset Public.json``: a JSON array of objects with
    ``qid`` (int), ``image_name`` (e.g. "synpic54610.jpg", in ``VQA_RAD Image Folder``), ``question``, ``answer``
    (a string; a few are stored as numbers), ``answer_type`` ("OPEN" / "CLOSED", sometimes with stray spaces),
    ``question_type``, ``phrase_type`` ("freeform", "para", "test_freeform", "test_para": the test split is the rows
    whose phrase_type starts with "test"), ``image_organ``, ``question_rephrase``, ``question_relation``,
    ``question_frame``, ``qid_linked_id``, ``image_case_url``, ``evaluation``.
    The Hugging Face export (flaviagiammarino/vqa-rad) has only ``image`` (embedded), ``question`` and ``answer``."""
    hf = ctx.layout == "hf"
    image_field = "image" if hf and "image_name" not in row else "image_name"
    qid = _ident(row, "qid", optional=hf)
    question = _text(row, "question")
    answer = _text(row, "answer", number_ok=True)
    answer_type = _text(row, "answer_type", optional=hf)
    if answer_type is not None and answer_type.upper() not in ("OPEN", "CLOSED"):
        raise RowError("answer_type", f"expected OPEN or CLOSED, got {answer_type!r}")
    phrase_type = _text(row, "phrase_type", optional=True)
    split = ctx.options.get("split")
    if split is not None:
        if phrase_type is None:
            raise RowError("phrase_type", "missing, so the row's split is unknown (needed for split=)")
        if ("test" if phrase_type.startswith("test") else "train") != split:
            raise _Filtered()
    image = _image(ctx, image_field, _text(row, image_field))
    closed = answer_type.upper() == "CLOSED" if answer_type else answer.lower() in ("yes", "no")
    meta = {
        "source_file": str(ctx.source),
        "row": index,
        "source_id": qid,
        "split": None if phrase_type is None else ("test" if phrase_type.startswith("test") else "train"),
        **{k: row.get(k) for k in ("question_type", "phrase_type", "image_organ") if row.get(k) is not None},
    }
    task_id = f"vqa_rad-{qid}" if qid is not None else f"vqa_rad-{ctx.source.name}-{index}"
    return _open_task(ctx, task_id, question, answer, [image], meta, closed)


def _map_slake(row: dict, ctx: _Context, index: int) -> Task:
    """SLAKE (Liu et al. 2021), ``Slake1.0/{train,validate,test}.json``: JSON arrays of objects with ``qid`` (int),
    ``img_id`` (int), ``img_name`` (e.g. "xmlab102/source.jpg", relative to ``Slake1.0/imgs``), ``question``,
    ``answer`` (a string; a few are numbers), ``q_lang`` ("en" / "zh"), ``answer_type`` ("OPEN" / "CLOSED"),
    ``location``, ``modality``, ``base_type``, ``content_type``, ``triple``."""
    qid = _ident(row, "qid")
    lang = _text(row, "q_lang")
    languages = ctx.options.get("languages")
    if languages is not None and lang not in languages:
        raise _Filtered()
    question = _text(row, "question")
    answer = _text(row, "answer", number_ok=True)
    answer_type = _text(row, "answer_type")
    if answer_type.upper() not in ("OPEN", "CLOSED"):
        raise RowError("answer_type", f"expected OPEN or CLOSED, got {answer_type!r}")
    image = _image(ctx, "img_name", _text(row, "img_name"))
    meta = {
        "source_file": str(ctx.source),
        "row": index,
        "source_id": qid,
        "language": lang,
        **{k: row.get(k) for k in ("img_id", "location", "modality", "content_type", "base_type")
           if row.get(k) is not None},
    }
    return _open_task(ctx, f"slake-{qid}", question, answer, [image], meta, answer_type.upper() == "CLOSED")


def _map_path_vqa(row: dict, ctx: _Context, index: int) -> Task:
    """PathVQA (He et al. 2020), ``pvqa/qas/<split>/<split>_qa.pkl``: a pickled list of dicts with ``image`` (a name
    without extension, e.g. "train_0422", the file being ``pvqa/images/<split>/train_0422.jpg``), ``question`` and
    ``answer``; the LXMERT-style ``<split>_vqa.pkl`` rows (``img_id``, ``sent``, ``label`` {answer: score},
    ``question_id``) are read too, as are the same rows saved as JSON / JSONL. The Hugging Face export
    (flaviagiammarino/path-vqa) has ``image`` (embedded), ``question`` and ``answer``. Yes/no answers are closed."""
    if "sent" in row:  # LXMERT layout
        image_field, question = "img_id", _text(row, "sent")
        label = _get(row, "label")
        if not isinstance(label, dict) or not label:
            raise RowError("label", f"expected a non-empty {{answer: score}} mapping, got {label!r}")
        answer = max(label.items(), key=lambda kv: (kv[1], kv[0]))[0]
        if not isinstance(answer, str) or not answer.strip():
            raise RowError("label", f"answer {answer!r} is not a non-empty string")
        answer = answer.strip()
        source_id = _ident(row, "question_id", optional=True)
    else:
        image_field, question = "image", _text(row, "question")
        answer = _text(row, "answer", number_ok=True)
        source_id = None
    name = _text(row, image_field)
    split_dir = name.split("_", 1)[0] if "_" in name and not Path(name).is_absolute() else None
    # pvqa/images/<split>/<name>.jpg first, then <image_root>/<name>(.jpg)
    candidates = ([f"{split_dir}/{name}"] if split_dir and ctx.layout != "hf" else []) + [name]
    image = _image(ctx, image_field, candidates, try_extensions=True)
    meta = {"source_file": str(ctx.source), "row": index, "image_name": name}
    if source_id is not None:
        meta["source_id"] = source_id
    task_id = f"path_vqa-{source_id}" if source_id is not None else f"path_vqa-{ctx.source.stem}-{index}"
    return _open_task(ctx, task_id, question, answer, [image], meta, answer.lower() in ("yes", "no"))


_CHOICE_PREFIX = re.compile(r"^\s*([A-D])\s*[:.)]\s*")


def _map_pmc_vqa(row: dict, ctx: _Context, index: int) -> Task:
    """PMC-VQA (Zhang et al. 2023), CSV with a header. v1 (``train.csv``, ``test.csv``, ``test_clean.csv``):
    ``Figure_path``, ``Question``, ``Answer`` (the answer text), ``Choice A`` .. ``Choice D`` (values written
    "A:CT scan", the "A:" prefix is removed), ``Answer_label`` (the letter). v2 (``train_2.csv``, ``test_2.csv``):
    ``index``, ``Figure_path``, ``Caption``, ``Question``, ``Choice A`` .. ``Choice D``, ``Answer`` (the letter),
    ``split``. ``Figure_path`` is relative to the images folder (``images/`` of images.zip / images_2.zip)."""
    question = _text(row, "Question")
    options = {}
    for letter in "ABCD":
        text = _text(row, f"Choice {letter}")
        prefix = _CHOICE_PREFIX.match(text)
        if prefix and prefix.group(1) != letter:
            raise RowError(f"Choice {letter}", f"starts with the label of option {prefix.group(1)}: {text!r}")
        options[letter] = text[prefix.end() :].strip() if prefix else text
        if not options[letter]:
            raise RowError(f"Choice {letter}", "empty after its label")
    label = _text(row, "Answer_label", optional=True)
    answer = _text(row, "Answer", optional=label is not None)
    if label is not None:
        letter, answer_field = label.strip().rstrip(":.").upper(), "Answer_label"
    elif answer is not None and re.fullmatch(r"[A-Da-d][:.)]?", answer):
        letter, answer_field = answer[0].upper(), "Answer"
    else:
        matches = [k for k, v in options.items() if answer is not None and v.casefold() == _strip_choice(answer)]
        if len(matches) != 1:
            raise RowError("Answer", f"{answer!r} is neither an option letter nor the text of exactly one option")
        letter, answer_field = matches[0], "Answer"
    if letter not in options:
        raise RowError(answer_field, f"{letter!r} is not one of the option letters A-D")
    image = _image(ctx, "Figure_path", _text(row, "Figure_path"))
    source_id = _ident(row, "index", optional=True)
    meta = {"source_file": str(ctx.source), "row": index, "figure_path": row["Figure_path"]}
    if source_id is not None:
        meta["source_id"] = source_id
    if _text(row, "split", optional=True):
        meta["split"] = row["split"].strip()
    task_id = f"pmc_vqa-{source_id}" if source_id is not None else f"pmc_vqa-{ctx.source.stem}-{index}"
    return _mcq_task(ctx, task_id, question, options, letter, [image], meta)


def _strip_choice(text: str) -> str:
    prefix = _CHOICE_PREFIX.match(text)
    return (text[prefix.end() :] if prefix else text).strip().casefold()


def _map_medxpertqa(row: dict, ctx: _Context, index: int) -> Task:
    """MedXpertQA (Zuo et al. 2025, TsinghuaC3I/MedXpertQA), ``MM/{dev,test}.jsonl`` and ``Text/{dev,test}.jsonl``:
    one object a line with ``id`` ("MM-0", "Text-12"), ``question`` (the stem, already ending in
    "Answer Choices: (A) ... (E) ..."), ``options`` (letter -> text: A-E for MM, A-J for Text), ``label`` (the
    letter), ``images`` (MM only: file names in the ``images/`` folder of images.zip), ``medical_task``,
    ``body_system``, ``question_type``. The question is used verbatim (its choices are not listed twice)."""
    source_id = _ident(row, "id")
    question = _text(row, "question")
    raw = _get(row, "options")
    if not isinstance(raw, dict) or len(raw) < 2:
        raise RowError("options", f"expected a mapping of >= 2 option letters to texts, got {raw!r}")
    options = {}
    for key in sorted(raw):
        if not (isinstance(key, str) and len(key) == 1 and key in LETTERS):
            raise RowError("options", f"option key {key!r} is not a letter A-J")
        options[key] = _text(raw, key)
    if list(options) != list(LETTERS[: len(options)]):
        raise RowError("options", f"option letters {list(options)} are not consecutive from A")
    letter = _text(row, "label")
    if letter not in options:
        raise RowError("label", f"{letter!r} is not one of the option letters {list(options)}")
    names = _get(row, "images", optional=True) or []
    if not isinstance(names, list) or not all(isinstance(n, str) and n.strip() for n in names):
        raise RowError("images", f"expected a list of image file names, got {names!r}")
    images = [_image(ctx, "images", n) for n in names]
    meta = {
        "source_file": str(ctx.source),
        "row": index,
        "source_id": source_id,
        **{k: row.get(k) for k in ("medical_task", "body_system", "question_type") if row.get(k) is not None},
    }
    listed = "Answer Choices:" in question
    return _mcq_task(ctx, f"medxpertqa-{source_id}", question, options, letter, images, meta, list_options=not listed)


def _map_omnimedvqa(row: dict, ctx: _Context, index: int) -> Task:
    """OmniMedVQA (Hu et al. 2024), ``QA_information/{Open,Restricted}-access/<dataset>.json``: JSON arrays of objects
    with ``dataset``, ``question_id``, ``question_type``, ``question``, ``gt_answer`` (the text of the right option),
    ``image_path`` (relative to the OmniMedVQA root, e.g. "Images/ACRIMA/Im001_ACRIMA.png"), ``option_A`` ..
    ``option_D`` (two to four of them), ``modality_type`` (one file spells it ``modality``)."""
    source_id = _ident(row, "question_id")
    question = _text(row, "question")
    options = {}
    for letter in "ABCD":
        text = _text(row, f"option_{letter}", optional=True, number_ok=True)
        if text is None:
            break
        options[letter] = text
    for letter in "ABCD"[len(options) :]:
        if row.get(f"option_{letter}") not in (None, ""):
            raise RowError(f"option_{letter}", f"present although option_{'ABCD'[len(options)]} is missing")
    if len(options) < 2:
        raise RowError("option_B" if options else "option_A", "missing (a question needs at least two options)")
    gt = _text(row, "gt_answer", number_ok=True)
    matches = [k for k, v in options.items() if v == gt] or [
        k for k, v in options.items() if _norm_answer(v) == _norm_answer(gt)
    ]
    if len(matches) != 1:
        found = "no option" if not matches else f"options {matches}"
        raise RowError("gt_answer", f"{gt!r} matches {found} of {options}")
    image = _image(ctx, "image_path", _text(row, "image_path"))
    meta = {
        "source_file": str(ctx.source),
        "row": index,
        "source_id": source_id,
        "modality_type": row.get("modality_type", row.get("modality")),
        **{k: row.get(k) for k in ("dataset", "question_type") if row.get(k) is not None},
    }
    return _mcq_task(ctx, f"omnimedvqa-{source_id}", question, options, matches[0], [image], meta)


def _norm_answer(text: str) -> str:
    return " ".join(text.casefold().strip().rstrip(".").split())


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


def load_vqa_rad(path, image_root=None, *, split: str | None = None, skip_bad: bool = False,
                 verify_images: bool = False) -> LoadResult:
    """VQA-RAD from ``VQA_RAD Dataset Public.json``; ``split`` 'train' or 'test' keeps that split (by phrase_type).
    Images default to ``VQA_RAD Image Folder`` beside the JSON file. Layout: see :func:`_map_vqa_rad`."""
    if split not in (None, "train", "test"):
        raise ValueError(f"vqa_rad: split must be 'train', 'test' or None, not {split!r}")
    path, ctx, result = _start("vqa_rad", path, image_root, verify_images, {"split": split})
    ctx.image_root = ctx.image_root or _default_root(path, path.parent / "VQA_RAD Image Folder")
    _run(ctx, _json_array_rows(path), _map_vqa_rad, skip_bad, result)
    return result


def load_slake(path, image_root=None, *, languages: Iterable[str] | None = None, skip_bad: bool = False,
               verify_images: bool = False) -> LoadResult:
    """SLAKE from one of ``train.json`` / ``validate.json`` / ``test.json``; ``languages`` (e.g. ["en"]) keeps those
    ``q_lang`` values. Images default to ``imgs`` beside the JSON file. Layout: see :func:`_map_slake`."""
    langs = None if languages is None else frozenset([languages] if isinstance(languages, str) else languages)
    path, ctx, result = _start("slake", path, image_root, verify_images, {"languages": langs})
    ctx.image_root = ctx.image_root or _default_root(path, path.parent / "imgs")
    _run(ctx, _json_array_rows(path), _map_slake, skip_bad, result)
    return result


def load_path_vqa(path, image_root=None, *, skip_bad: bool = False, verify_images: bool = False) -> LoadResult:
    """PathVQA from a ``*_qa.pkl`` / ``*_vqa.pkl`` (plain data only: class references are refused) or the same rows
    as ``.json`` / ``.jsonl``. Images default to the ``images`` folder of the pvqa root (``qas/<split>/x.pkl`` ->
    ``images``). Layout: see :func:`_map_path_vqa`."""
    path, ctx, result = _start("path_vqa", path, image_root, verify_images)
    ctx.image_root = ctx.image_root or _default_root(
        path, *(p / "images" for p in (path.parent, path.parent.parent, path.parent.parent.parent))
    )
    suffix = path.suffix.lower()
    rows = _pickle_rows(path) if suffix in (".pkl", ".pickle") else (
        _jsonl_rows(path) if suffix == ".jsonl" else _json_array_rows(path))
    _run(ctx, rows, _map_path_vqa, skip_bad, result)
    return result


def load_pmc_vqa(path, image_root=None, *, skip_bad: bool = False, verify_images: bool = False) -> LoadResult:
    """PMC-VQA from a v1 or v2 CSV. Images default to ``images`` (else ``figures``) beside the CSV. Layout: see
    :func:`_map_pmc_vqa`."""
    path, ctx, result = _start("pmc_vqa", path, image_root, verify_images)
    ctx.image_root = ctx.image_root or _default_root(path, path.parent / "images", path.parent / "figures")
    required = ["Figure_path", "Question", "Choice A", "Choice B", "Choice C", "Choice D"]
    rows = _csv_rows(path, required, alternatives=[("Answer", "Answer_label")])
    _run(ctx, rows, _map_pmc_vqa, skip_bad, result)
    return result


def load_medxpertqa(path, image_root=None, *, skip_bad: bool = False, verify_images: bool = False) -> LoadResult:
    """MedXpertQA from ``MM/<split>.jsonl`` or ``Text/<split>.jsonl``. Images default to ``images`` beside the
    subset folder (``MM/../images``), else beside the file. Layout: see :func:`_map_medxpertqa`."""
    path, ctx, result = _start("medxpertqa", path, image_root, verify_images)
    ctx.image_root = ctx.image_root or _default_root(path, path.parent.parent / "images", path.parent / "images")
    _run(ctx, _jsonl_rows(path), _map_medxpertqa, skip_bad, result)
    return result


def load_omnimedvqa(path, image_root=None, *, skip_bad: bool = False, verify_images: bool = False) -> LoadResult:
    """OmniMedVQA from one ``<dataset>.json`` or a folder of them (``QA_information``, ``Open-access``, ...; read in
    sorted order). ``image_path`` values resolve against the OmniMedVQA root, by default the folder above
    ``QA_information``. Layout: see :func:`_map_omnimedvqa`."""
    path, ctx, result = _start("omnimedvqa", path, image_root, verify_images)
    files = sorted(path.rglob("*.json")) if path.is_dir() else [path]
    if not files:
        raise BenchmarkFormatError(f"{path}: no .json files")
    if ctx.image_root is None:
        qa_info = next((p for p in [path, *path.parents] if p.name == "QA_information"), None)
        if qa_info is None:
            raise BenchmarkFormatError(f"{path}: not inside a QA_information folder; pass image_root (the "
                                       "OmniMedVQA root that image_path values are relative to)")
        ctx.image_root = qa_info.parent
    for file in files:
        ctx.source = file
        _run(ctx, _json_array_rows(file), _map_omnimedvqa, skip_bad, result)
    return result


MAPPERS = {
    "vqa_rad": _map_vqa_rad,
    "slake": _map_slake,
    "path_vqa": _map_path_vqa,
    "pmc_vqa": _map_pmc_vqa,
    "medxpertqa": _map_medxpertqa,
    "omnimedvqa": _map_omnimedvqa,
}
LOADERS = {
    "vqa_rad": load_vqa_rad,
    "slake": load_slake,
    "path_vqa": load_path_vqa,
    "pmc_vqa": load_pmc_vqa,
    "medxpertqa": load_medxpertqa,
    "omnimedvqa": load_omnimedvqa,
}


def hf_available() -> bool:
    try:
        import datasets  # noqa: F401
    except ImportError:
        return False
    return True


def load_hf_saved(path, benchmark: str, *, split: str | None = None, image_root=None, image_dir=None,
                  skip_bad: bool = False, verify_images: bool = False, **options) -> LoadResult:
    """A Hugging Face ``datasets`` folder written by ``save_to_disk`` (a Dataset or a DatasetDict; name ``split`` when
    it holds several). Rows must follow ``benchmark``'s published layout, or for ``vqa_rad`` / ``path_vqa`` the HF
    export's ``image`` / ``question`` / ``answer``. Image columns (``datasets.Image`` features, single or lists) are
    read undecoded: embedded bytes are written once to ``image_dir`` (default ``cache_dir()/benchmark_images/
    <benchmark>``) under their sha256, paths without bytes resolve against ``image_root``. Needs ``datasets``.
    ``options`` go to the row mapper (``languages`` for slake, ``split`` for vqa_rad is the dataset split here)."""
    if benchmark not in MAPPERS:
        raise ValueError(f"unknown benchmark {benchmark!r}; choose from {sorted(MAPPERS)}")
    datasets = require("datasets", "medical")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{benchmark}: {path} does not exist")
    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        if split is None and len(data) == 1:
            split = next(iter(data))
        if split not in data:
            raise ValueError(f"{path}: name a split (split=...): it has {sorted(data)}")
        data = data[split]
    image_columns = []
    for name, feature in data.features.items():
        inner = getattr(feature, "feature", None)
        if isinstance(feature, datasets.Image):
            data = data.cast_column(name, datasets.Image(decode=False))
            image_columns.append(name)
        elif isinstance(inner, datasets.Image):
            data = data.cast_column(name, type(feature)(datasets.Image(decode=False)))
            image_columns.append(name)
    if "languages" in options and options["languages"] is not None and isinstance(options["languages"], str):
        options["languages"] = [options["languages"]]
    if options.get("languages") is not None:
        options["languages"] = frozenset(options["languages"])
    ctx = _Context(benchmark, path, Path(image_root) if image_root is not None else None, verify_images, "hf",
                   options)
    out_dir = Path(image_dir) if image_dir is not None else _hf_image_dir(benchmark)
    label = f"{path} [{split}]" if split else str(path)
    result = LoadResult(benchmark, label, [])

    def rows() -> Rows:
        for i, row in enumerate(data):
            where = f"{label}, row {i}"
            try:
                for col in image_columns:
                    row[col] = _materialise(row[col], col, out_dir)
            except RowError as e:
                yield where, i, _BadRow(str(e))
                continue
            yield where, i, row

    _run(ctx, rows(), MAPPERS[benchmark], skip_bad, result)
    return result


def _hf_image_dir(benchmark: str) -> Path:
    from tasks.hpo import cache_dir

    return cache_dir() / "benchmark_images" / benchmark


def _materialise(value, column: str, out_dir: Path):
    """An undecoded ``datasets.Image`` value ({'bytes', 'path'}, or a list of them) -> path string(s)."""
    if isinstance(value, list):
        return [_materialise(v, column, out_dir) for v in value]
    if not isinstance(value, dict):
        raise RowError(column, f"expected an image, got {value!r}")
    data, name = value.get("bytes"), value.get("path")
    if data:
        digest = hashlib.sha256(data).hexdigest()[:24]
        suffix = Path(name).suffix.lower() if name and Path(name).suffix else _sniff_suffix(data, column)
        target = out_dir / f"{digest}{suffix}"
        if not target.is_file():
            out_dir.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(target.suffix + f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, target)
        return str(target)
    if name:
        return name
    raise RowError(column, "image has neither bytes nor a path")


def _sniff_suffix(data: bytes, column: str) -> str:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            return "." + (im.format or "png").lower().replace("jpeg", "jpg")
    except Exception as e:  # noqa: BLE001
        raise RowError(column, f"embedded bytes are not an image ({type(e).__name__}: {e})") from None


def load_benchmark(benchmark: str, path, **kwargs) -> LoadResult:
    """Dispatch to ``LOADERS[benchmark]`` (or :func:`load_hf_saved` with ``benchmark='hf', layout=...``)."""
    if benchmark == "hf":
        layout = kwargs.pop("layout", None)
        if layout is None:
            raise ValueError("benchmark 'hf' needs layout=<one of " + ", ".join(sorted(MAPPERS)) + ">")
        return load_hf_saved(path, layout, **kwargs)
    if benchmark not in LOADERS:
        raise ValueError(f"unknown benchmark {benchmark!r}; choose from {sorted(LOADERS) + ['hf']}")
    return LOADERS[benchmark](path, **kwargs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tasks.loaders", description="Convert a benchmark on disk into "
                                     "a medray task file (JSONL).")
    parser.add_argument("benchmark", choices=sorted(LOADERS) + ["hf"])
    parser.add_argument("path", type=Path, help="annotation file (or folder: omnimedvqa, hf)")
    parser.add_argument("--out", type=Path, required=True, help="task JSONL to write")
    parser.add_argument("--image-root", type=Path, default=None)
    parser.add_argument("--skip-bad", action="store_true", help="skip malformed rows (and report them) instead of "
                        "stopping at the first")
    parser.add_argument("--verify-images", action="store_true", help="open every image with PIL")
    parser.add_argument("--split", default=None, help="vqa_rad: train/test; hf: the dataset split")
    parser.add_argument("--languages", nargs="+", default=None, help="slake: q_lang values to keep, e.g. en")
    parser.add_argument("--layout", choices=sorted(MAPPERS), default=None, help="hf: the rows' benchmark layout")
    parser.add_argument("--image-dir", type=Path, default=None, help="hf: where embedded images are written")
    a = parser.parse_args(argv)
    kwargs: dict[str, Any] = {"image_root": a.image_root, "skip_bad": a.skip_bad, "verify_images": a.verify_images}
    if a.benchmark == "vqa_rad" or (a.benchmark == "hf" and a.split):
        kwargs["split"] = a.split
    if a.languages and (a.benchmark == "slake" or a.layout == "slake"):
        kwargs["languages"] = a.languages
    if a.benchmark == "hf":
        kwargs.update(layout=a.layout, image_dir=a.image_dir)
    result = load_benchmark(a.benchmark, a.path, **kwargs)
    n = write_tasks(a.out, result.tasks)
    print(result.summary())
    for error in result.errors:
        print(f"  skipped: {error}")
    print(f"wrote {n} tasks to {a.out}")


if __name__ == "__main__":
    main()

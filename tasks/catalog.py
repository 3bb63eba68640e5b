"""Task sets by name: a JSONL path, `<world>:<split>` of a medical world medray builds itself, or
`phenopackets:<path>#<split>` of real cases on the HPO world's disease split (tasks/phenopacket_tasks.py)."""
from __future__ import annotations

from pathlib import Path

from cluster.files import cache_dir
from tasks.schema import TaskFormatError, read_tasks, resolve_image_paths


#: The HPO world's seed; real cases (phenopackets:) are split on the disease split this seed makes.
HPO_WORLD_SEED = 0


def _builtin_worlds() -> dict:
    """The medical worlds medray builds itself, by prefix: each takes what follows `<prefix>:` and returns
    ({split name: path}, the split named), building once."""
    # The builders pull in scikit-image and the world generators: imported only when a built-in world is asked for.
    from tasks.build_hpo import ensure_hpo_world
    from tasks.build_imaging import ensure_imaging_world
    from tasks.phenopacket_tasks import phenopacket_world

    return {"hpo": lambda split: (ensure_hpo_world(cache_dir() / "hpo_world", seed=HPO_WORLD_SEED), split),
            "imaging": lambda split: (ensure_imaging_world(progress=False), split),
            "phenopackets": lambda rest: phenopacket_world(rest, seed=HPO_WORLD_SEED)}


def resolve_tasks_path(spec: str) -> Path:
    """A JSONL path, `<world>:<split>` for a built-in world (hpo:mcq_train, imaging:finding_mcq_train, ...), or
    `phenopackets:<path>#<split>[,strict]` (mcq_train, mcq_test, open_train, open_test)."""
    world, _, split = spec.partition(":")
    worlds = _builtin_worlds() if split else {}
    if world in worlds:
        paths, split = worlds[world](split)
        if split not in paths:
            raise ValueError(f"data.train: unknown {world} split {split!r}; choose from {sorted(paths)}")
        return Path(paths[split])
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"data.train: {path} does not exist")
    return path


def load_tasks(spec: str | list[str]) -> list[dict]:
    """Task records as plain dicts (they travel to actors); malformed lines raise naming file and line.
    Relative image paths are resolved against the task file's directory, and every image must exist and open as an
    image (checked here, so a wrong path or a damaged file fails before any actor starts, naming the file, the task
    and the field). A list of task-set names
    (`data.train: [hpo:mcq_train, phenopackets:...#mcq_train]`) gives their tasks one after the other; a task id
    two of them share is an error naming both."""
    if not isinstance(spec, str):
        return _load_mixture(list(spec))
    path = resolve_tasks_path(spec)
    tasks = [resolve_image_paths(t, path.parent) for t in read_tasks(path)]
    if not tasks:
        raise TaskFormatError(f"{path}: no tasks (the file has no non-blank lines)")
    for task in tasks:
        for i, image in enumerate(task.images):
            if not Path(image).is_file():
                raise TaskFormatError(f"{path}: task {task.id!r}: field 'images.{i}': image not found: {image}")
            if (problem := unreadable_image(image)) is not None:
                raise TaskFormatError(f"{path}: task {task.id!r}: field 'images.{i}': {image} is not an image the "
                                      f"model's processor can take ({problem})")
    return [t.model_dump(mode="json") for t in tasks]


def unreadable_image(path: str) -> str | None:
    """Why PIL cannot open and verify `path` as an image (PIL's `verify` reads the file once, decoding nothing), or
    None."""
    from PIL import Image, UnidentifiedImageError
    try:
        with Image.open(path) as image:
            image.verify()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _load_mixture(specs: list[str]) -> list[dict]:
    if not specs:
        raise TaskFormatError("data.train: an empty list of task sets")
    tasks, first = [], {}
    for spec in specs:
        for task in load_tasks(spec):
            if task["id"] in first:
                raise TaskFormatError(f"{spec}: field 'id': task {task['id']!r} is also in {first[task['id']]}")
            first[task["id"]] = spec
            tasks.append(task)
    return tasks

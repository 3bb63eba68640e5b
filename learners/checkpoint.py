"""Checkpoints: `checkpoints/step_<N>/` in Hugging Face format plus DeepSpeed and trainer state, written atomically.

A checkpoint is assembled in a hidden temporary directory, given a manifest of sha256 checksums, and renamed into
place; `checkpoints/latest` is a symlink swapped by rename. A crash at any point leaves the previous checkpoint
intact and `latest` pointing at a complete one.

With a `storage.path` the committed checkpoint is then published there: every node uploads the files it holds,
and the manifest goes up last, so a checkpoint without one on storage (an upload cut short) is never read.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
from pathlib import Path

import ray

from cluster.files import sha256_file, verify_manifest
from cluster.storage import MANIFEST, Storage, newest_valid

log = logging.getLogger("medray.checkpoint")
STATE = "trainer_state.json"
RUN_CONFIG = "run.yaml"  # the resolved config of the stage that wrote the checkpoint


def staging_dir(root: Path, step: int) -> Path:
    """A new, empty directory to write step `step`'s checkpoint into; every rank writes its share at this path on its
    own node. The name is fresh each time, so no node finds an earlier attempt's files there."""
    for old in root.glob(f".step_{step}.*.tmp"):
        shutil.rmtree(old, ignore_errors=True)
    tmp = root / f".step_{step}.{secrets.token_hex(4)}.tmp"
    tmp.mkdir(parents=True)
    return tmp


def checksums(directory: str | Path) -> dict[str, str]:
    """{relative path: sha256} of every file under `directory`."""
    directory = Path(directory)
    return {str(p.relative_to(directory)): sha256_file(p) for p in sorted(directory.rglob("*")) if p.is_file()}


def commit(root: Path, tmp: Path, step: int, state: dict, keep_last: int,
           elsewhere: dict[str, str] | None = None) -> Path:
    """Write the trainer state and manifest into `tmp`, move it to `step_<step>`, point `latest` at it, and
    delete all but the newest `keep_last` checkpoints. The manifest lists the files here and `elsewhere` (files
    other nodes hold, with their checksums). Returns the committed checkpoint's path."""
    (tmp / STATE).write_text(json.dumps(state, indent=1))
    files = {**(elsewhere or {}), **checksums(tmp)}
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": dict(sorted(files.items()))}, indent=1))
    final = root / f"step_{step}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    point_latest(root, final.name)
    for old in sorted(_steps(root))[:-keep_last]:
        shutil.rmtree(root / f"step_{old}", ignore_errors=True)
    return final


def assign_uploads(local: set[str], held: dict[int, dict[str, str]]) -> dict[int, list[str]]:
    """Which learner rank uploads which file: each file the driver's node lacks goes to the first rank (of those
    listed in `held`, one per other node) holding it; the driver uploads what it holds itself."""
    taken, assigned = set(local), {}
    for rank in sorted(held):
        assigned[rank] = sorted(set(held[rank]) - taken)
        taken |= set(held[rank])
    return assigned


def publish(storage: Storage, local_step: Path, upload_others, keep_last: int) -> None:
    """Put committed checkpoint `local_step` at `checkpoints/<name>` on storage: the files present here from this
    node while the other nodes upload theirs (`upload_others(uri)` starts that and returns a function that waits
    for it); then the manifest, last; then all but the newest `keep_last` committed checkpoints are deleted there."""
    rel = f"checkpoints/{local_step.name}"
    storage.delete_dir(rel)  # a cut-short upload of this step, from before a resume
    here = [name for name in listed(local_step) if (local_step / name).is_file()]
    wait_for_others = upload_others(storage.uri(rel))
    storage.upload(local_step, here, rel)
    wait_for_others()
    storage.upload(local_step, [MANIFEST], rel)
    if storage.local:  # a directory or mount: `checkpoints/latest` as in output_dir
        point_latest(Path(storage.path("checkpoints")), local_step.name)
    storage.prune_steps("checkpoints", keep_last)


def commit_and_publish(storage: Storage, root: Path, tmp: Path, step: int, state: dict, keep_last: int,
                       learners) -> None:
    """`commit` here, then `publish` to storage. Learner ranks on other nodes wrote their shares of `tmp` on their own
    disks: `learners` (a LearnerGroup) lists them there and uploads them from there."""
    held = learners.shares(tmp, ray.get_runtime_context().get_node_id())
    final = commit(root, tmp, step, state, keep_last,
                   elsewhere={name: digest for share in held.values() for name, digest in share.items()})
    assigned = assign_uploads({name for name in listed(final) if (final / name).is_file()}, held)
    publish(storage, final, lambda uri: learners.upload_shares(tmp, assigned, uri), keep_last)


def publish_run_files(storage: Storage, out: Path) -> None:
    """Every file of the run outside `checkpoints/` (metrics.jsonl, config.yaml, TensorBoard, evaluations) to the
    same place on storage, each replaced whole."""
    for path in sorted(out.rglob("*")):
        rel = path.relative_to(out)
        if path.is_file() and rel.parts[0] != "checkpoints" and not rel.name.startswith("."):
            storage.replace(path, str(rel.as_posix()))


def pull_run_files(storage: Storage, out: Path) -> None:
    """The run's files on storage (outside `checkpoints/`) that `out` lacks: a resume on a node that never ran it."""
    for rel in storage.files():
        if not rel.startswith("checkpoints/") and not (out / rel).exists():
            storage.download_file(rel, out / rel)


def point_latest(root: Path, name: str) -> None:
    """Swap the symlink `root/latest` to `name` by a rename: a reader sees the old target or the new."""
    link = root / ".latest.tmp"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(name)
    os.replace(link, root / "latest")


def _steps(root: Path) -> list[int]:
    return [int(p.name[5:]) for p in root.glob("step_*") if p.name[5:].isdigit()]


def listed(path: Path) -> list[str]:
    """The files the manifest of checkpoint `path` lists."""
    return list(json.loads((path / MANIFEST).read_text())["files"])


def verify(path: Path) -> str | None:
    """None if every file in the manifest is present with its checksum, else what is wrong."""
    return verify_manifest(path, MANIFEST)


def latest_valid(root: Path) -> Path | None:
    """The newest checkpoint that verifies, warning about each newer one that does not."""
    for step in sorted(_steps(root), reverse=True):
        path = root / f"step_{step}"
        problem = verify(path)
        if problem is None:
            return path
        log.warning("checkpoint %s is damaged (%s); trying the previous one", path, problem)
    return None


def refuse_existing_run(out: Path, storage: Storage | None) -> None:
    """Raise FileExistsError when `out` or `storage` already holds a run (a fresh run never overwrites one)."""
    for where, kept in ((f"output_dir {out}", Storage(str(out))), (f"storage.path {storage and storage.location}",
                                                                    storage)):
        if kept and (kept.exists("metrics.jsonl") or kept.exists("checkpoints")):
            raise FileExistsError(f"{where} already holds a run; pass resume=true to continue it, or choose another "
                                  f"(nothing there was changed)")


def resume_point(root: Path, storage: Storage | None) -> tuple[Path | None, str | None]:
    """(local checkpoint to resume from, its URI when it came from storage): the newest that verifies, on storage
    when the run has one (fetched under `root`, with the run's other files this node lacks), else under `root`."""
    if storage is None:
        return latest_valid(root), None
    found = newest_valid(storage.uri("checkpoints"), root)
    pull_run_files(storage, root.parent)
    return (found[1], found[0]) if found else (None, None)


def refuse_other_learner(checkpoint: Path, lora: bool) -> None:
    """A LoRA run's checkpoint (it holds `adapter/`) resumes only with `learner.lora` set, a full fine-tuning run's
    only without: raise naming both."""
    written = (checkpoint / "adapter").is_dir()
    if written != lora:
        wrote = "a LoRA run" if written else "a full fine-tuning run"
        trains = "LoRA adapters (learner.lora is set)" if lora else "every weight (learner.lora is null)"
        raise ValueError(f"checkpoint {checkpoint} was written by {wrote}, but the config trains {trains}: resume it "
                         f"with the learner that wrote it")


def read_state(path: Path) -> dict:
    return json.loads((path / STATE).read_text())

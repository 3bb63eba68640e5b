"""Checkpoints: `checkpoints/step_<N>/` in Hugging Face format plus DeepSpeed and trainer state, written atomically.

A checkpoint is assembled in a hidden temporary directory, given a manifest of sha256 checksums, and renamed into
place; `checkpoints/latest` is a symlink swapped by rename. A crash at any point leaves the previous checkpoint
intact and `latest` pointing at a complete one.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from tasks.files import sha256_file, verify_manifest

log = logging.getLogger("medray.checkpoint")
MANIFEST = "manifest.json"
STATE = "trainer_state.json"
RUN_CONFIG = "run.yaml"  # the resolved config of the stage that wrote the checkpoint


def staging_dir(root: Path, step: int) -> Path:
    """An empty directory to write step `step`'s checkpoint into (shared storage: every rank can write there)."""
    tmp = root / f".step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit(root: Path, tmp: Path, step: int, state: dict, keep_last: int) -> Path:
    """Write the trainer state and manifest into `tmp`, move it to `step_<step>`, point `latest` at it, and
    delete all but the newest `keep_last` checkpoints."""
    (tmp / STATE).write_text(json.dumps(state, indent=1))
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    manifest = {"step": step, "files": {str(p.relative_to(tmp)): sha256_file(p) for p in files}}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    final = root / f"step_{step}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    link = root / ".latest.tmp"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(final.name)
    os.replace(link, root / "latest")
    for old in sorted(_steps(root))[:-keep_last]:
        shutil.rmtree(root / f"step_{old}", ignore_errors=True)
    return final


def _steps(root: Path) -> list[int]:
    return [int(p.name[5:]) for p in root.glob("step_*") if p.name[5:].isdigit()]


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


def read_state(path: Path) -> dict:
    return json.loads((path / STATE).read_text())

"""What every builder shares: where medray's caches live, content checksums and manifests, an exclusive build lock,
build arguments with defaults."""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable


def cache_dir() -> Path:
    """Root of medray's caches: ``$MEDRAY_CACHE`` or ``~/.cache/medray``."""
    return Path(os.environ.get("MEDRAY_CACHE") or Path.home() / ".cache" / "medray")


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_manifest(directory: str | os.PathLike, manifest: str = "manifest.json",
                    skip: Callable[[str], bool] = lambda name: False) -> str | None:
    """None if every file listed in `directory/manifest` ({"files": {relative path: sha256}}) is present with its
    checksum, else what is wrong; files for which `skip(name)` holds are not read."""
    directory = Path(directory)
    try:
        listed = json.loads((directory / manifest).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"no readable manifest ({e})"
    for name, digest in listed.items():
        if skip(name):
            continue
        f = directory / name
        if not f.is_file():
            return f"{name} is missing"
        if sha256_file(f) != digest:
            return f"{name} does not match its checksum"
    return None


@contextmanager
def file_lock(path: str | os.PathLike):
    """An exclusive advisory lock on ``path`` (POSIX), held for the with-block: concurrent builders wait."""
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def with_defaults(sizes: dict, defaults: dict, what: str) -> dict:
    """``defaults`` overridden by ``sizes``; an unknown name is an error, not silently ignored."""
    unknown = set(sizes) - set(defaults)
    if unknown:
        raise TypeError(f"unknown {what} arguments {sorted(unknown)}; known: {sorted(defaults)}")
    return {**defaults, **sizes}


@contextmanager
def building_dir(out: str | os.PathLike, replace: bool = False):
    """Yield a fresh temporary sibling of `out` to build into; on success it becomes `out` by a rename, on failure it
    is removed, so concurrent or interrupted builds never leave a half-written directory at `out`. An existing `out`
    is replaced when `replace`; otherwise (a deterministic build another process finished first) it is kept."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        if replace:
            shutil.rmtree(out, ignore_errors=True)
        try:
            tmp.rename(out)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_jsonl(path: str | os.PathLike, rows) -> int:
    """Write `rows` (dicts) as JSONL, one compact object a line, through a temporary sibling renamed into place (a
    reader never sees half a file, and a failed write leaves the old file as it was); return how many were written."""
    import json
    from pathlib import Path

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    n = 0
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as fh:
            for row in rows:
                fh.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n")
                n += 1
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return n

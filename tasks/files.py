"""What every builder shares: content checksums, an exclusive build lock, build arguments with defaults."""
from __future__ import annotations

import fcntl
import hashlib
import os
from contextlib import contextmanager


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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

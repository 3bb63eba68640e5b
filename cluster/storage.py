"""A run's storage: a local directory, an NFS mount, or a URI of any filesystem pyarrow.fs or fsspec knows (`s3://`,
`gs://`, `file://`, ...), the way Ray Train addresses its storage.

A directory on storage is committed by its manifest (`manifest.json`, {"files": {relative path: sha256}}), which is
written after every file it lists: a reader takes only directories whose manifest is there, and verifies the
checksums once it has the files locally. Directories are read back through Ray Train's `Checkpoint`, whose
`to_directory` lets one process per node download while the others wait.
"""
from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shutil
from pathlib import Path, PurePosixPath

import pyarrow.fs as pafs

from cluster.files import cache_dir as cache_root, file_lock, verify_manifest

log = logging.getLogger("medray.storage")
MANIFEST = "manifest.json"


def is_uri(path: str | os.PathLike) -> bool:
    """Whether `path` names a filesystem by scheme (`s3://bucket/run`, `file:///mnt/run`) rather than a local path."""
    return "://" in str(path)


def filesystem(location: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path on it) for a local path or a URI: pyarrow's own filesystems first, then fsspec's (as Ray
    Train resolves `storage_path`). Raises ValueError naming the location when neither knows its scheme."""
    if not is_uri(location):
        return pafs.LocalFileSystem(), str(Path(location).expanduser().absolute())
    try:
        return pafs.FileSystem.from_uri(location)
    except (pafs.ArrowInvalid, pafs.ArrowNotImplementedError) as arrow_error:
        import fsspec
        try:
            fs, path = fsspec.core.url_to_fs(location)
        except (ImportError, ValueError) as e:
            raise ValueError(f"storage {location}: no filesystem for it ({arrow_error}; fsspec: {e})") from None
        return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path




class Storage:
    """A directory on some filesystem, addressed by paths relative to it."""

    def __init__(self, location: str):
        self.location = location.rstrip("/")
        self.fs, self.root = filesystem(self.location)

    @property
    def local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    def path(self, rel: str = "") -> str:
        """`rel` (relative even with a leading '/') on this filesystem."""
        rel = rel.strip("/")
        return str(PurePosixPath(self.root, rel)) if rel else self.root

    def uri(self, rel: str = "") -> str:
        rel = rel.strip("/")
        return f"{self.location}/{rel}" if rel else self.location

    def exists(self, rel: str) -> bool:
        return self.fs.get_file_info(self.path(rel)).type != pafs.FileType.NotFound

    def upload(self, local_dir: str | os.PathLike, names, rel: str) -> None:
        """Copy the files `names` (relative to `local_dir`) to `rel/<name>` on storage, as they are."""
        for name in names:
            dest = self.path(str(PurePosixPath(rel, name)))
            self.fs.create_dir(str(PurePosixPath(dest).parent), recursive=True)
            pafs.copy_files(str(Path(local_dir) / name), dest, source_filesystem=pafs.LocalFileSystem(),
                            destination_filesystem=self.fs)

    def replace(self, local_file: str | os.PathLike, rel: str) -> None:
        """Put one file at `rel` through a temporary sibling moved over it: a reader sees the old file or the new."""
        dest = self.path(rel)
        tmp = str(PurePosixPath(dest).with_name(f".{PurePosixPath(dest).name}.{secrets.token_hex(4)}.tmp"))
        self.fs.create_dir(str(PurePosixPath(dest).parent), recursive=True)
        pafs.copy_files(str(local_file), tmp, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=self.fs)
        self.fs.move(tmp, dest)

    def files(self, rel: str = "") -> list[str]:
        """Every file under `rel`, relative to it (none when it does not exist)."""
        base = self.path(rel)
        if self.fs.get_file_info(base).type != pafs.FileType.Directory:
            return []
        infos = self.fs.get_file_info(pafs.FileSelector(base, recursive=True))
        return sorted(str(PurePosixPath(i.path).relative_to(base)) for i in infos if i.type == pafs.FileType.File)

    def download_file(self, rel: str, local: str | os.PathLike) -> None:
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        pafs.copy_files(self.path(rel), str(local), source_filesystem=self.fs,
                        destination_filesystem=pafs.LocalFileSystem())

    def delete_dir(self, rel: str) -> None:
        if self.exists(rel):
            self.fs.delete_dir(self.path(rel))

    # ---- committed step directories (`<rel>/step_<N>/` with a manifest) -----------------------------------------
    def steps(self, rel: str) -> list[int]:
        """The N of every `rel/step_<N>` directory, committed or not, ascending."""
        base = self.path(rel)
        if self.fs.get_file_info(base).type != pafs.FileType.Directory:
            return []
        names = [PurePosixPath(i.path).name for i in self.fs.get_file_info(pafs.FileSelector(base))
                 if i.type == pafs.FileType.Directory]
        return sorted(int(n[5:]) for n in names if n.startswith("step_") and n[5:].isdigit())

    def committed_steps(self, rel: str) -> list[int]:
        """Steps under `rel` whose manifest is there (written last), ascending: a half-uploaded one is left out."""
        return [s for s in self.steps(rel) if self.exists(f"{rel}/step_{s}/{MANIFEST}")]

    def prune_steps(self, rel: str, keep_last: int) -> None:
        """Delete every step directory under `rel` older than the newest `keep_last` committed ones."""
        committed = self.committed_steps(rel)
        if len(committed) < keep_last:
            return
        oldest_kept = committed[-keep_last]
        for step in self.steps(rel):
            if step < oldest_kept:
                self.delete_dir(f"{rel}/step_{step}")

    def fetch(self, rel: str, local: str | os.PathLike, trust_present: bool = False) -> Path:
        """A verified local copy of the committed directory `rel` at `local`: a copy already there is kept when it
        verifies (when `trust_present`: when every file its manifest lists is present), else replaced by a download
        that must verify. One process per node downloads (a lock beside `local`). Raises ValueError when the
        directory is not committed or does not verify."""
        local = Path(local)
        local.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(local.parent / f".{local.name}.lock"):
            if complete(local) if trust_present else verify_manifest(local, MANIFEST) is None:
                return local
            if not self.exists(f"{rel}/{MANIFEST}"):
                raise ValueError(f"{self.uri(rel)} is not a committed checkpoint (no {MANIFEST})")
            from ray.train import Checkpoint  # Ray Train's storage reader; heavy, and only needed to read storage
            tmp = local.with_name(f".{local.name}.{secrets.token_hex(4)}.download")
            try:
                Checkpoint(self.path(rel), filesystem=self.fs).to_directory(str(tmp))
                problem = verify_manifest(tmp, MANIFEST)
                if problem:
                    raise ValueError(f"{self.uri(rel)} does not verify: {problem}")
                shutil.rmtree(local, ignore_errors=True)
                os.replace(tmp, local)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return local


def run_storage(location: str | None, output_dir: str | os.PathLike) -> Storage | None:
    """The storage a run publishes to: None without a location, or when it is `output_dir` itself."""
    if not location:
        return None
    storage = Storage(location)
    return None if storage.local and Path(storage.root).resolve() == Path(output_dir).expanduser().resolve() \
        else storage


def upload_share(local_dir: str | os.PathLike, names: list[str], destination: str) -> None:
    """A node's share of a directory other nodes upload too: `names` (relative to `local_dir`) to `destination`,
    then deleted here with the directories they leave empty (`local_dir` was a staging area on this node)."""
    Storage(destination).upload(local_dir, names, "")
    for name in names:
        (Path(local_dir) / name).unlink()
    for directory in sorted((p for p in Path(local_dir).rglob("*") if p.is_dir()), reverse=True) + [Path(local_dir)]:
        if not any(directory.iterdir()):
            directory.rmdir()


def complete(local: Path) -> bool:
    """Whether every file the manifest of `local` lists is present (checksums are verified when downloaded)."""
    import json
    try:
        listed = json.loads((local / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return all((local / name).is_file() for name in listed)


def split_checkpoint_uri(uri: str) -> tuple[str, str | None]:
    """(storage location of a run's `checkpoints/` directory, step directory name or None for the newest): for
    `.../checkpoints/latest`, `.../checkpoints` and `.../checkpoints/step_<N>`."""
    uri = uri.rstrip("/")
    head, _, last = uri.rpartition("/")
    if last == "latest":
        return head, None
    if last.startswith("step_") and last[5:].isdigit():
        return head, last
    return uri, None


def newest_valid(checkpoints_uri: str, local_root: str | os.PathLike) -> tuple[str, Path] | None:
    """(URI, local copy) of the newest committed checkpoint under `checkpoints_uri` that verifies, fetched into
    `local_root/step_<N>`; each newer one that does not verify is named in a warning. None when there is none."""
    storage = Storage(checkpoints_uri)
    for step in reversed(storage.committed_steps("")):
        name = f"step_{step}"
        try:
            return storage.uri(name), storage.fetch(name, Path(local_root) / name)
        except (ValueError, OSError) as e:
            log.warning("checkpoint %s is damaged (%s); trying the previous one", storage.uri(name), e)
    return None


def cache_dir(uri: str) -> Path:
    """Where a node keeps its copies of checkpoints read from storage: `$MEDRAY_CACHE/checkpoints/<hash of uri>`."""
    return cache_root() / "checkpoints" / hashlib.sha256(uri.encode()).hexdigest()[:16]


def fetch_checkpoint(checkpoint: str) -> tuple[str, Path]:
    """(URI of the exact step, its verified local copy in this node's cache) for a checkpoint URI; `latest` and a bare
    `checkpoints/` resolve to the newest committed one that verifies. Raises ValueError naming the URI when there is
    none."""
    location, step = split_checkpoint_uri(checkpoint)
    if step is not None:
        return f"{location}/{step}", Storage(location).fetch(step, cache_dir(location) / step)
    found = newest_valid(location, cache_dir(location))
    if found is None:
        raise ValueError(f"no committed checkpoint that verifies under {location}")
    return found


def local_checkpoint(checkpoint: str) -> str:
    """A local directory holding `checkpoint`: itself when it is a local path, else its copy fetched from storage."""
    return str(fetch_checkpoint(checkpoint)[1]) if is_uri(checkpoint) else checkpoint

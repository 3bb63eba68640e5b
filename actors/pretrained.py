"""Hugging Face vision models behind the model-backed tools (actors.segmentation, actors.super_resolution): real
weights from a local directory, or a tiny random-initialised model of the same architecture.

The tiny model is built once, deterministically (seed `TINY_SEED`), into ``cluster.files.cache_dir()/models/<key>``, the
key hashing its config, its processor and the build version, and saved as ``save_pretrained`` writes a published
checkpoint, so it loads through the same ``from_pretrained`` code as real weights. Nothing is ever fetched: a path
must be a local directory, and loads are ``local_files_only``.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from cluster.files import building_dir, cache_dir

TINY_SEED = 0
TINY_BUILD_VERSION = 1  # bump when the build code changes what it makes


def tiny_key(name: str, config, processor) -> str:
    """`name-tiny-<hash>` of everything that shapes the build (the config's dict names the transformers version)."""
    blob = json.dumps({"config": config.to_dict(), "processor": processor.to_dict(), "seed": TINY_SEED,
                       "build": TINY_BUILD_VERSION}, sort_keys=True, default=str)
    return f"{name}-tiny-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def ensure_tiny_pretrained(name: str, config, model_class, processor) -> Path:
    """Build (once) and return the directory of `model_class(config)`, seeded, with `processor`; written to a
    temporary sibling and renamed, so concurrent builders never see half a model."""
    import torch

    out = cache_dir() / "models" / tiny_key(name, config, processor)
    if (out / "config.json").exists():
        return out
    with building_dir(out) as tmp:
        with torch.random.fork_rng(devices=[]):  # the caller's random stream is not disturbed by the build
            torch.manual_seed(TINY_SEED)
            model = model_class(config)
        model.save_pretrained(tmp, safe_serialization=True)
        processor.save_pretrained(tmp)
    return out


def local_model_dir(path: str | os.PathLike | None, model_type: str | tuple[str, ...], tiny) -> Path:
    """The directory to load: `path`, checked to be a local Hugging Face directory of `model_type` (its
    config.json's field; a tuple: any of them), or, when `path` is None, `tiny()` (the builder of the tiny default)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach a hub, even by accident
    if path is None:
        return tiny()
    config = Path(path) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"option 'path': {path} is not a local Hugging Face model directory (no config.json)")
    found = json.loads(config.read_text()).get("model_type")
    accepted = (model_type,) if isinstance(model_type, str) else tuple(model_type)
    if found not in accepted:
        *rest, last = map(repr, accepted)
        listing = f"{', '.join(rest)} or {last}" if rest else last
        raise ValueError(f"option 'path': {config} has model_type {found!r}; this tool loads {listing}")
    return Path(path)


def default_device(device: str | None) -> str:
    """The caller's device, else cuda where torch sees one, else cpu."""
    import torch

    return device or ("cuda" if torch.cuda.is_available() else "cpu")

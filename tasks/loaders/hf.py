"""Benchmarks saved with Hugging Face `datasets` (`save_to_disk`), mapped by the layout of the benchmark they hold."""
from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

from tasks.extras import require
from tasks.loaders.common import _BadRow, _Context, LoadResult, RowError, Rows, _run
from tasks.loaders.mcq import _map_medxpertqa, _map_omnimedvqa, _map_pmc_vqa
from tasks.loaders.vqa import _map_path_vqa, _map_slake, _map_vqa_rad


MAPPERS = {
    "vqa_rad": _map_vqa_rad,
    "slake": _map_slake,
    "path_vqa": _map_path_vqa,
    "pmc_vqa": _map_pmc_vqa,
    "medxpertqa": _map_medxpertqa,
    "omnimedvqa": _map_omnimedvqa,
}


def hf_available() -> bool:
    try:
        import datasets  # noqa: F401
    except ImportError:
        return False
    return True


def load_hf_saved(path, benchmark: str, *, split: str | None = None, image_root=None, image_dir=None,
                  skip_bad: bool = False, verify_images: bool = False, **options) -> LoadResult:
    """A Hugging Face ``datasets`` folder written by ``save_to_disk`` (a Dataset or a DatasetDict; name ``split`` when
    it holds several). Rows must follow ``benchmark``'s published layout, or for ``vqa_rad`` / ``path_vqa`` the HF
    export's ``image`` / ``question`` / ``answer``. Image columns (``datasets.Image`` features, single or lists) are
    read undecoded: embedded bytes are written once to ``image_dir`` (default ``cache_dir()/benchmark_images/
    <benchmark>``) under their sha256, paths without bytes resolve against ``image_root``. Needs ``datasets``.
    ``options`` go to the row mapper (``languages`` for slake, ``split`` for vqa_rad is the dataset split here)."""
    if benchmark not in MAPPERS:
        raise ValueError(f"unknown benchmark {benchmark!r}; choose from {sorted(MAPPERS)}")
    datasets = require("datasets", "medical")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{benchmark}: {path} does not exist")
    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        if split is None and len(data) == 1:
            split = next(iter(data))
        if split not in data:
            raise ValueError(f"{path}: name a split (split=...): it has {sorted(data)}")
        data = data[split]
    image_columns = []
    for name, feature in data.features.items():
        inner = getattr(feature, "feature", None)
        if isinstance(feature, datasets.Image):
            data = data.cast_column(name, datasets.Image(decode=False))
            image_columns.append(name)
        elif isinstance(inner, datasets.Image):
            data = data.cast_column(name, type(feature)(datasets.Image(decode=False)))
            image_columns.append(name)
    if "languages" in options and options["languages"] is not None and isinstance(options["languages"], str):
        options["languages"] = [options["languages"]]
    if options.get("languages") is not None:
        options["languages"] = frozenset(options["languages"])
    ctx = _Context(benchmark, path, Path(image_root) if image_root is not None else None, verify_images, "hf",
                   options)
    out_dir = Path(image_dir) if image_dir is not None else _hf_image_dir(benchmark)
    label = f"{path} [{split}]" if split else str(path)
    result = LoadResult(benchmark, label, [])

    def rows() -> Rows:
        for i, row in enumerate(data):
            where = f"{label}, row {i}"
            try:
                for col in image_columns:
                    row[col] = _materialise(row[col], col, out_dir)
            except RowError as e:
                yield where, i, _BadRow(str(e))
                continue
            yield where, i, row

    _run(ctx, rows(), MAPPERS[benchmark], skip_bad, result)
    return result


def _hf_image_dir(benchmark: str) -> Path:
    from cluster.files import cache_dir

    return cache_dir() / "benchmark_images" / benchmark


def _materialise(value, column: str, out_dir: Path):
    """An undecoded ``datasets.Image`` value ({'bytes', 'path'}, or a list of them) -> path string(s)."""
    if isinstance(value, list):
        return [_materialise(v, column, out_dir) for v in value]
    if not isinstance(value, dict):
        raise RowError(column, f"expected an image, got {value!r}")
    data, name = value.get("bytes"), value.get("path")
    if data:
        digest = hashlib.sha256(data).hexdigest()[:24]
        suffix = Path(name).suffix.lower() if name and Path(name).suffix else _sniff_suffix(data, column)
        target = out_dir / f"{digest}{suffix}"
        if not target.is_file():
            out_dir.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(target.suffix + f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, target)
        return str(target)
    if name:
        return name
    raise RowError(column, "image has neither bytes nor a path")


def _sniff_suffix(data: bytes, column: str) -> str:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            return "." + (im.format or "png").lower().replace("jpeg", "jpg")
    except Exception as e:  # noqa: BLE001
        raise RowError(column, f"embedded bytes are not an image ({type(e).__name__}: {e})") from None

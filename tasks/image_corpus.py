"""CDIR's image-caption corpus: a JSONL of {id, image, caption} rows whose images lie beside it; the imaging
world's own is the default."""
from __future__ import annotations

import json
import os
from pathlib import Path

CORPUS_FIELDS = ("id", "image", "caption")


def read_image_corpus(path: str | os.PathLike) -> list[dict]:
    """The corpus rows in file order, each with ``image_path`` (absolute) added; a line that is not JSON with string
    fields id, image and caption, or whose image file is missing, raises ValueError naming file, line and field."""
    path = Path(path)
    rows = []
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}:{lineno}: not a UTF-8 JSON line ({e})") from None
            missing = [f for f in CORPUS_FIELDS if not isinstance(row, dict) or not isinstance(row.get(f), str)]
            if missing:
                raise ValueError(f"{path}:{lineno}: field {missing[0]!r}: missing or not a string "
                                 f"(a corpus row has {', '.join(CORPUS_FIELDS)})")
            image_path = (path.parent / row["image"]).resolve()
            if not image_path.is_file():
                raise ValueError(f"{path}:{lineno}: field 'image': {image_path} does not exist")
            rows.append({**row, "image_path": str(image_path)})
    if not rows:
        raise ValueError(f"{path}: no corpus rows")
    return rows


def default_corpus() -> Path:
    """The imaging world's CDIR corpus (built on first use)."""
    from tasks.build_imaging import ensure_imaging_world
    return ensure_imaging_world(progress=False)["cdir_corpus"]

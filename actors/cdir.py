"""Confidence-Driven Image Re-retrieval (CDIR), Med-RwR's test-time scaling (the Med-RwR paper, sec. 3.3,
Eqns. 6-7, appendix D.2.2, Algorithm 1):

    eta = pi_theta(y_hat_{tau+1} | x, y_hat_{<=tau}, h, k)                                                  (Eqn. 6)
    y ~ pi_theta(. | i, t, h, k'),  k' = k if eta >= lambda, else k ∪ k_sim(i, D)                          (Eqn. 7)

tau is the position of `<answer>`, so eta is the probability of the predicted option token right after it; lambda is
0.8. When eta < lambda the most similar image-caption pair of the corpus D (BiomedCLIP image cosine,
:mod:`actors.image_index`) joins the context after the reasoning history h, k (the final answer turn is dropped) and
the model answers again.

Where eta comes from: the log-probability the rollout engine reported for the sampled token (`Trajectory.logprobs`),
not a second forward pass. Evaluation decodes greedily and vLLM's greedy path returns log-softmax of the logits before
any temperature (the rollout worker's `processed_logprobs` equal the model's own distribution when no penalties are
set), so this is exactly pi_theta of Eqn. 6, at no extra cost. (With temperature sampling the processed value is the
tempered distribution; the engine's `prompt_logprobs` of the sequence would then be the exact, one-prefill-dearer
choice.) "Right after `<answer>`" skips whitespace-only tokens: in `<answer>\\nB` the token that names the option is
"B", not the newline. An episode without a complete answer block has no eta, and CDIR does not fire for it.

The retrieved case is shown as an observation of the grammar (`<retrieve>Similar case ...: caption</retrieve>`), the
way the policy already reads retrieved knowledge. A text-only policy gets the caption; the similar image itself needs
the rollout worker to take images in a continuation (see :func:`apply_cdir`).
"""
from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from actors.environment import Grammar, derive_seed
from actors.trajectory import Trajectory

THRESHOLD = 0.8


def token_pieces(tokenizer, ids: list[int]) -> list[str]:
    """Each token decoded on its own; their concatenation is the text the offsets below refer to."""
    return tokenizer.batch_decode([[t] for t in ids], skip_special_tokens=False)


def answer_token_index(pieces: list[str], answer_tag: str = "answer") -> int | None:
    """Index of the token at tau+1: the first token after the last complete `<answer>...</answer>` block's opening
    tag that holds a non-whitespace character of the answer; None without such a block or with an empty one."""
    text = "".join(pieces)
    blocks = list(re.finditer(rf"<{answer_tag}>(.*?)</{answer_tag}>", text, flags=re.S))
    if not blocks:
        return None
    content = blocks[-1]
    first = re.search(r"\S", content.group(1))
    if first is None:
        return None
    char = content.start(1) + first.start()
    end = 0
    for i, piece in enumerate(pieces):
        end += len(piece)
        if end > char:
            return i
    return None


def answer_confidence(pieces: list[str], logprobs: list[float], loss_mask: list[int],
                      answer_tag: str = "answer") -> float | None:
    """eta (Eqn. 6) = exp(log-prob of the token at tau+1), if the policy wrote that token; else None."""
    i = answer_token_index(pieces, answer_tag)
    if i is None or not loss_mask[i]:
        return None
    return math.exp(logprobs[i])


def cdir_fires(confidence: float | None, threshold: float = THRESHOLD) -> bool:
    """Algorithm 1: re-retrieve exactly when eta < lambda (an episode with no eta never fires)."""
    return confidence is not None and confidence < threshold


def final_turn_start(loss_mask: list[int]) -> int:
    """Where the policy's last generation (the answer turn) begins: the start of the trailing run of policy tokens.
    Everything before it is the reasoning history h and the retrieved knowledge k that Eqn. 7 keeps."""
    i = len(loss_mask)
    while i > 0 and loss_mask[i - 1]:
        i -= 1
    return i


def case_text(hit: dict) -> str:
    """The retrieved image-caption pair as the policy reads it."""
    return f"Similar case (image similarity {hit['score']:.2f}): {hit['caption']}"


def mean_or_none(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return float(np.mean(kept)) if kept else None


def cdir_summary(before: list[float | None], after: list[float | None], correct_before: list[bool],
                 correct_after: list[bool], fired: list[bool], threshold: float) -> dict:
    """How often CDIR fired, and accuracy and mean eta before and after: over all episodes and over those it fired on
    (Med-RwR's Fig. 3c reports the latter's confidence)."""
    on = [i for i, f in enumerate(fired) if f]
    return {"threshold": threshold, "n": len(fired), "fired": len(on), "fire_rate": len(on) / max(len(fired), 1),
            "without_confidence": sum(c is None for c in before),
            "accuracy_before": float(np.mean(correct_before)) if fired else None,
            "accuracy_after": float(np.mean(correct_after)) if fired else None,
            "confidence_before": mean_or_none(before), "confidence_after": mean_or_none(after),
            "fired_accuracy_before": float(np.mean([correct_before[i] for i in on])) if on else None,
            "fired_accuracy_after": float(np.mean([correct_after[i] for i in on])) if on else None,
            "fired_confidence_before": mean_or_none([before[i] for i in on]),
            "fired_confidence_after": mean_or_none([after[i] for i in on])}


def reanswered(traj: Trajectory, observation_ids: list[int], generated: dict, record: dict, tokenizer) -> Trajectory:
    """The trajectory with its answer turn replaced by the case observation (loss mask 0) and the new answer."""
    keep = final_turn_start(traj.loss_mask)
    ids = traj.response_ids[:keep] + observation_ids + generated["ids"]
    return dataclasses.replace(
        traj, response_ids=ids, text=tokenizer.decode(ids, skip_special_tokens=False),
        logprobs=traj.logprobs[:keep] + [0.0] * len(observation_ids) + generated["logprobs"],
        loss_mask=traj.loss_mask[:keep] + [0] * len(observation_ids) + [1] * len(generated["ids"]),
        finish_reason=generated["finish_reason"], turns=[*traj.turns, record])


def apply_cdir(trajectories: list[Trajectory], workers: list, image_retriever, tokenizer, grammar: Grammar,
               sampling: dict, seed: int, threshold: float = THRESHOLD) -> tuple[list[Trajectory], dict]:
    """Algorithm 1 over finished episodes: eta of each; for those below ``threshold`` whose task has an image, the
    top image-caption pair from ``image_retriever`` (an ImageRetriever actor) joins the context and the rollout
    ``workers`` answer again (one generation ending at `</answer>`, as Algorithm 1 regenerates y once).

    Returns the final trajectories (re-answered where CDIR fired, each with a turn record ``{"cdir": ...}``) and
    :func:`cdir_summary` plus per-episode records. Text-only policies: the caption joins the context. A multimodal
    policy's trajectories carry images, and its continuation needs the worker to take them (not yet there): refused.
    """
    import ray

    from rewards.builtin import answer_correct

    pieces = [token_pieces(tokenizer, t.response_ids) for t in trajectories]
    before = [answer_confidence(p, t.logprobs, t.loss_mask, grammar.answer_tag) for p, t in zip(pieces, trajectories)]
    fired = [cdir_fires(c, threshold) and bool(t.task.get("images")) for c, t in zip(before, trajectories)]
    on = [i for i, f in enumerate(fired) if f]
    if any(trajectories[i].images for i in on):
        raise NotImplementedError("CDIR re-answer of a multimodal policy needs RolloutWorker to continue an episode "
                                  "with images (the retrieved case's image); only text-only policies are supported")
    final, after = list(trajectories), list(before)
    if on:
        hits = ray.get(image_retriever.search.remote([trajectories[i].task["images"][0] for i in on], 1))
        observations = [tokenizer.encode(grammar.wrap_observation(case_text(h[0])), add_special_tokens=False)
                        [:grammar.max_observation_tokens] for h in hits]
        prompts = [t.prompt_ids + t.response_ids[:final_turn_start(t.loss_mask)] + obs
                   for t, obs in zip([trajectories[i] for i in on], observations)]
        params = {**sampling, "stop": sorted(set(sampling.get("stop") or []) | {f"</{grammar.answer_tag}>"})}
        seeds = [derive_seed(seed, i, "cdir") for i in on]
        parts = np.array_split(np.arange(len(on)), len(workers))
        refs = [w.generate.remote([prompts[j] for j in part], params, [seeds[j] for j in part])
                for w, part in zip(workers, parts) if len(part)]
        generated = [g for ref in refs for g in ray.get(ref)]
        for i, hit, obs, gen in zip(on, hits, observations, generated):
            record = {"cdir": {"confidence": before[i], "threshold": threshold, "case_id": hit[0]["id"],
                               "caption": hit[0]["caption"], "image_path": hit[0]["image_path"],
                               "score": hit[0]["score"]}}
            final[i] = reanswered(trajectories[i], obs, gen, record, tokenizer)
            after[i] = answer_confidence(token_pieces(tokenizer, gen["ids"]), gen["logprobs"], [1] * len(gen["ids"]),
                                         grammar.answer_tag)
    summary = cdir_summary(before, after, [answer_correct(t) for t in trajectories],
                           [answer_correct(t) for t in final], fired, threshold)
    summary["episodes"] = [{"task_id": t.task.get("id"), "fired": f, "confidence_before": b, "confidence_after": a}
                           for t, f, b, a in zip(trajectories, fired, before, after)]
    return final, summary

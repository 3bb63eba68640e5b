"""Confidence-Driven Image Re-retrieval (CDIR), Med-RwR's test-time scaling (the Med-RwR paper, sec. 3.3,
Eqns. 6-7, appendix D.2.2, Algorithm 1):

    eta = pi_theta(y_hat_{tau+1} | x, y_hat_{<=tau}, h, k)                                                  (Eqn. 6)
    y ~ pi_theta(. | i, t, h, k'),  k' = k if eta >= lambda, else k ∪ k_sim(i, D)                          (Eqn. 7)

tau is the position of `<answer>`, so eta is the probability of the predicted option token right after it; lambda is
0.8. When eta < lambda the most similar image-caption pair of the corpus D (BiomedCLIP image cosine,
:mod:`indexing.image_index`) joins the context after the reasoning history h, k (the final answer turn is dropped) and
the model answers again.

Where eta comes from: the log-probability the rollout engine reported for the sampled token (`Trajectory.logprobs`),
not a second forward pass. Evaluation decodes greedily and vLLM's greedy path returns log-softmax of the logits before
any temperature (the rollout worker's `processed_logprobs` equal the model's own distribution when no penalties are
set), so this is exactly pi_theta of Eqn. 6, at no extra cost. (With temperature sampling the processed value is the
tempered distribution; the engine's `prompt_logprobs` of the sequence would then be the exact, one-prefill-dearer
choice.) "Right after `<answer>`" skips whitespace-only tokens: in `<answer>\\nB` the token that names the option is
"B", not the newline. An episode without a complete answer block has no eta, and CDIR does not fire for it.

The retrieved case is shown as an observation of the grammar, the way the policy already reads retrieved knowledge: a
multimodal policy gets the case's image and caption, as the paper integrates "the retrieved image feature and text
tokens" (`<retrieve><|vision_start|><|image_pad|>...<|vision_end|>Similar case ...: caption</retrieve>`, the image
placed as an environment's images are, :func:`actors.episode.observation_tokens`); a text-only policy, which
cannot take the image, gets the caption alone.
"""
from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
from PIL import Image

from actors.episode import derive_seed, observation_tokens, rgb_array
from actors.grammar import Grammar
from actors.image_tokens import ImageTokens
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


def case_image(hit: dict) -> np.ndarray:
    """The retrieved case's image (RGB array), read from its corpus file."""
    with Image.open(hit["image_path"]) as image:
        return rgb_array(image)


def case_observation(hit: dict, tokenizer, grammar: Grammar, vision: ImageTokens | None
                     ) -> tuple[list[int], list[np.ndarray], list[tuple[int, int, int]]]:
    """The retrieved case as the policy reads it: for a multimodal policy (`vision`) its image (a full run of pads)
    then its caption inside the observation tags, for a text-only one (None) the caption alone; at most
    `grammar.max_observation_tokens` tokens (an image that does not fit is dropped whole). Returns the ids and the
    images shown with their patch grids."""
    return observation_tokens(tokenizer, grammar, vision, case_text(hit), [case_image(hit)] if vision else [],
                              grammar.max_observation_tokens)


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


def reanswered(traj: Trajectory, observation_ids: list[int], generated: dict, record: dict, tokenizer,
               images: list = (), grids: list = ()) -> Trajectory:
    """The trajectory with its answer turn replaced by the case observation (loss mask 0; `images` with their `grids`:
    the ones it shows) and the new answer."""
    keep = final_turn_start(traj.loss_mask)
    ids = traj.response_ids[:keep] + observation_ids + generated["ids"]
    return dataclasses.replace(
        traj, response_ids=ids, text=tokenizer.decode(ids, skip_special_tokens=False),
        logprobs=traj.logprobs[:keep] + [0.0] * len(observation_ids) + generated["logprobs"],
        loss_mask=traj.loss_mask[:keep] + [0] * len(observation_ids) + [1] * len(generated["ids"]),
        finish_reason=generated["finish_reason"], turns=[*traj.turns, record], images=[*traj.images, *images],
        image_grids=[*traj.image_grids, *grids])


def apply_cdir(trajectories: list[Trajectory], workers: list, image_retriever, tokenizer, grammar: Grammar,
               sampling: dict, seed: int, threshold: float = THRESHOLD,
               vision: ImageTokens | None = None) -> tuple[list[Trajectory], dict]:
    """Algorithm 1 over finished episodes: eta of each; for those below ``threshold`` whose task has an image, the
    top image-caption pair from ``image_retriever`` (an ImageRetriever actor) joins the context and the rollout
    ``workers`` answer again (one generation ending at `</answer>`, as Algorithm 1 regenerates y once).

    ``vision``: the policy's image tokens (:meth:`ImageTokens.for_model`), None for a text-only policy. A multimodal
    policy is shown the case's image and caption after its own images, a text-only one the caption
    (:func:`case_observation`). Returns the final trajectories (re-answered where CDIR fired, each with a turn record
    ``{"cdir": ...}``) and :func:`cdir_summary` plus per-episode records (the case shown, where it fired).
    """
    import ray

    from rewards.builtin import answer_correct

    if vision is None and any(t.images for t in trajectories):
        raise ValueError("apply_cdir: the trajectories hold images (a multimodal policy) but no `vision` was given")
    pieces = [token_pieces(tokenizer, t.response_ids) for t in trajectories]
    before = [answer_confidence(p, t.logprobs, t.loss_mask, grammar.answer_tag) for p, t in zip(pieces, trajectories)]
    fired = [cdir_fires(c, threshold) and bool(t.task.get("images")) for c, t in zip(before, trajectories)]
    on = [i for i, f in enumerate(fired) if f]
    final, after, cases = list(trajectories), list(before), {}
    if on:
        hits = [h[0] for h in ray.get(image_retriever.search.remote([trajectories[i].task["images"][0] for i in on],
                                                                    1))]
        shown = [case_observation(hit, tokenizer, grammar, vision) for hit in hits]
        chosen = [trajectories[i] for i in on]
        prompts = [t.prompt_ids + t.response_ids[:final_turn_start(t.loss_mask)] + ids
                   for t, (ids, _, _) in zip(chosen, shown)]
        images = [[*t.images, *case_images] for t, (_, case_images, _) in zip(chosen, shown)]
        params = {**sampling, "stop": sorted(set(sampling.get("stop") or []) | {f"</{grammar.answer_tag}>"})}
        seeds = [derive_seed(seed, i, "cdir") for i in on]
        parts = np.array_split(np.arange(len(on)), len(workers))
        refs = [w.generate.remote([prompts[j] for j in part], params, [seeds[j] for j in part],
                                  [images[j] for j in part]) for w, part in zip(workers, parts) if len(part)]
        generated = [g for ref in refs for g in ray.get(ref)]
        for i, hit, (ids, case_images, grids), gen in zip(on, hits, shown, generated):
            cases[i] = {"case_id": hit["id"], "caption": hit["caption"], "image_path": hit["image_path"],
                        "score": hit["score"], "image_shown": bool(case_images)}
            final[i] = reanswered(trajectories[i], ids, gen, {"cdir": {"confidence": before[i],
                                                                       "threshold": threshold, **cases[i]}},
                                  tokenizer, case_images, grids)
            after[i] = answer_confidence(token_pieces(tokenizer, gen["ids"]), gen["logprobs"], [1] * len(gen["ids"]),
                                         grammar.answer_tag)
    summary = cdir_summary(before, after, [answer_correct(t) for t in trajectories],
                           [answer_correct(t) for t in final], fired, threshold)
    summary["episodes"] = [{"task_id": t.task.get("id"), "fired": fired[i], "confidence_before": before[i],
                            "confidence_after": after[i], **cases.get(i, {})} for i, t in enumerate(trajectories)]
    return final, summary

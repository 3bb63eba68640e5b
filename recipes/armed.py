"""ARMed's plugin: medical thinking knowledge injection (ARMed, arXiv 2508.12957, sec. 3.4), a demonstration source.
The SFT stage between its two RL stages trains on the RL model's own reasoning for a compact, diverse set of
representative questions.

    D_core = {(x_i, y_i) | f(y_i) > tau}                       (Eqn. 12, f = frequency of the answer)
    C      = KMeans({E(x_i) | (x_i, y_i) in D_core})            (Eqn. 14, E = a sentence encoder)
    (x_k*, y_k*) = argmin_{(x_i, y_i) in c_k} ||E(x_i) - mu_k|| (Eqn. 15)

The trainer samples the current policy on those questions (an `sft` stage with `sft.data: self`) and keeps, per
question, its correct rollouts as demonstrations; a question with none keeps the policy's reasoning with the gold
answer in place of its own (the answer is the paper's "semantic anchor" that guides the reasoning).

    recipe: armed
    stages: [..., {name: inject, kind: sft, steps: 6,
                   sft: {data: self, batch_size: 16, args: {clusters: 32, samples: 4, min_answer_frequency: 1}}}, ...]

ARMed's rewards are rewards/adaptive.py (Adapt), rewards/semantic.py and rewards/nci.py.
"""
from __future__ import annotations

import logging
import re
from collections import Counter

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from recipes import Recipe, register_recipe

log = logging.getLogger("medray.recipes.armed")


def question_text(task: dict) -> str:
    """The last user message of a task (its text parts): what E(x) embeds."""
    content = [m for m in task["messages"] if m["role"] == "user"][-1]["content"]
    if isinstance(content, list):
        content = " ".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content


def representative_tasks(answers: list[str], embeddings: np.ndarray, min_frequency: int, clusters: int,
                         seed: int = 0) -> list[int]:
    """Indices of the representative questions: K-means (k = `clusters`, at most |D_core|) over the embeddings of
    the questions whose answer occurs more than `min_frequency` times, and in each cluster the question nearest its
    centroid. Deterministic given `seed`."""
    from scipy.cluster.vq import kmeans2

    counts = Counter(answers)
    core = [i for i, a in enumerate(answers) if counts[a] > min_frequency]
    if not core:
        raise ValueError(f"no answer occurs more than {min_frequency} times: lower sft.args.min_answer_frequency")
    k = min(clusters, len(core))
    points = embeddings[core].astype(np.float64)
    centroids, labels = kmeans2(points, k, seed=seed, minit="++")
    chosen = []
    for c in range(k):
        members = np.flatnonzero(labels == c)
        if len(members):
            nearest = members[np.argmin(np.linalg.norm(points[members] - centroids[c], axis=1))]
            chosen.append(core[int(nearest)])
    return sorted(chosen)


def segments_of(trajectory, tokenizer) -> list[dict]:
    """A trajectory as demonstration segments: each run of policy tokens or environment tokens, decoded."""
    segments, start = [], 0
    ids, mask = trajectory.response_ids, trajectory.loss_mask
    for end in range(1, len(ids) + 1):
        if end == len(ids) or mask[end] != mask[start]:
            segments.append({"role": "policy" if mask[start] else "environment",
                             "text": tokenizer.decode(ids[start:end], skip_special_tokens=False)})
            start = end
    return segments


def anchored_segments(segments: list[dict], gold: str, answer_tag: str = "answer") -> list[dict]:
    """The policy's segments with its final answer replaced by the gold one (text after the last <answer> dropped);
    a rollout that never answered gets the gold answer appended."""
    out = [dict(s) for s in segments]
    last_policy = max((i for i, s in enumerate(out) if s["role"] == "policy"), default=None)
    anchored = f"<{answer_tag}>{gold}</{answer_tag}>"
    if last_policy is None:
        return out + [{"role": "policy", "text": anchored}]
    text = out[last_policy]["text"]
    cut = text.rfind(f"<{answer_tag}>")
    out[last_policy]["text"] = (text[:cut] if cut >= 0 else re.sub(r"\s+$", "", text)) + anchored
    return out[:last_policy + 1]


class InjectionArgs(BaseModel):
    """`sft.args` of an `sft.data: self` stage."""
    model_config = ConfigDict(extra="forbid")

    min_answer_frequency: int = Field(1, ge=0, description="tau: answers occurring more often form D_core")
    clusters: int = Field(64, ge=1, description="K-means clusters over D_core = representative questions")
    samples: int = Field(4, ge=1, description="rollouts per representative question")


def generate_demonstrations(workers: list, tasks: list[dict], tokenizer, cfg, args: InjectionArgs, seed: int,
                            path) -> int:
    """Sample `args.samples` rollouts of each representative question of `tasks` on the rollout `workers` (the current
    policy) and write the demonstrations to `path`: a question's correct rollouts, or, if none is, its first rollout's
    reasoning anchored to the gold answer. Returns how many were written."""
    import ray

    from indexing.encoders import load_encoder
    from rewards.builtin import answer_correct
    from cluster.files import write_jsonl

    embeddings = load_encoder("minilm").encode([question_text(t) for t in tasks])
    chosen = representative_tasks([str(t["answer"]) for t in tasks], embeddings, args.min_answer_frequency,
                                  args.clusters, cfg.seed)
    parts = np.array_split(np.arange(len(chosen)), len(workers))
    refs = [w.rollout.options(num_returns=2).remote([tasks[chosen[i]] for i in part], part.tolist(), args.samples,
                                                    cfg.rollout.sampling(), seed, cfg.rollout.grammar.model_dump())[0]
            for w, part in zip(workers, parts)]
    demos = []
    for trajectories in ray.get(refs):
        by_question: dict[int, list] = {}
        for t in trajectories:
            by_question.setdefault(t.group, []).append(t)
        for group in by_question.values():
            correct = [t for t in group if answer_correct(t)]
            for t in correct or group[:1]:
                segments = segments_of(t, tokenizer)
                if not correct:
                    segments = anchored_segments(segments, str(t.task["answer"]), cfg.rollout.grammar.answer_tag)
                demos.append({"task": t.task, "segments": segments, "correct": bool(correct)})
    path.parent.mkdir(parents=True, exist_ok=True)
    written = write_jsonl(path, demos)
    log.info("knowledge injection: %d representative questions, %d demonstrations (%d from correct rollouts)",
             len(chosen), written, sum(d["correct"] for d in demos))
    return written


@register_recipe("armed")
class ARMed(Recipe):
    """`sft.data: self`: knowledge-injection demonstrations from the current policy."""
    demonstration_sources = ("self",)

    def check(self, cfg) -> None:
        for stage in cfg.stages:
            if stage.sft and stage.sft.data == "self":
                try:
                    InjectionArgs.model_validate(stage.sft.args)
                except ValidationError as e:
                    raise ValueError(f"stage {stage.name!r}: " + "; ".join(
                        f"sft.args.{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())) from None

    def write_demonstrations(self, source, *, workers, tasks, tokenizer, cfg, sft, seed, path) -> None:
        generate_demonstrations(workers, tasks, tokenizer, cfg, InjectionArgs.model_validate(sft.args), seed, path)

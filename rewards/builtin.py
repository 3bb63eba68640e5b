"""Rewards every grammar shares: tag format and answer accuracy."""
from __future__ import annotations

import re

from actors.trajectory import Trajectory
from rewards.registry import register_reward

_BLOCK = "<{tag}>(.*?)</{tag}>"


def extract_answer(text: str) -> str | None:
    """Content of the last complete <answer>...</answer> block, stripped; None if there is none."""
    found = re.findall(_BLOCK.format(tag="answer"), text, flags=re.S)
    return found[-1].strip() if found else None


def extract_option(answer: str, options: dict[str, str]) -> str | None:
    """The option letter an answer names: "B", "(B)", "B) Marfan syndrome", "Option b", or the option's text."""
    letters = "".join(options)
    m = re.match(rf"^\W*(?:option\s*)?([{letters}])(?:\W|$)", answer, flags=re.I)
    if m:
        return m.group(1).upper()
    norm = _normalise(answer)
    hits = [k for k, v in options.items() if _normalise(v) == norm]
    return hits[0] if len(hits) == 1 else None


def _normalise(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


@register_reward("tag_format")
def tag_format(trajectories: list[Trajectory], tags: tuple[str, ...] = ("think", "answer")) -> dict[str, list[float]]:
    """Soft format score in [0, 1]: the share of the 2n tags <t1> </t1> ... <tn> </tn> that appear exactly once
    and in this order, with a non-empty block between each pair.

    1.0 exactly when the response is <t1>..</t1> ... <tn>..</tn>. The partial credit is per tag, not per block,
    so a policy starting from random weights (which writes a given tag in ~2% of samples) gets a signal.
    """
    expected = [m for t in tags for m in (f"<{t}>", f"</{t}>")]
    scores = []
    for traj in trajectories:
        text, position, good = traj.text, 0, 0
        for k, marker in enumerate(expected):
            if text.count(marker) != 1:
                continue
            at = text.index(marker)
            opened_block = k % 2 == 1 and text.count(expected[k - 1]) == 1
            empty = opened_block and not text[text.index(expected[k - 1]) + len(expected[k - 1]):at].strip()
            if at >= position and not empty:
                good += 1
                position = at + len(marker)
        scores.append(good / len(expected))
    return {"format": scores}


def answer_correct(traj: Trajectory) -> bool:
    """The <answer> names the gold option (multiple choice) or equals, normalised, the gold answer or a reference."""
    answer, task = extract_answer(traj.text), traj.task
    if answer is None:
        return False
    if task.get("options"):
        return extract_option(answer, task["options"]) == task["answer"].strip().upper()
    gold = [task["answer"], *task.get("references", [])]
    return _normalise(answer) in {_normalise(g) for g in gold}


@register_reward("accuracy")
def accuracy(trajectories: list[Trajectory]) -> dict[str, list[float]]:
    """1 if the <answer> names the gold option (multiple choice) or equals the gold answer text, else 0."""
    return {"accuracy": [float(answer_correct(t)) for t in trajectories]}

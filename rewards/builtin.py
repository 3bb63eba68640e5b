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
    """Soft format score: the share of `tags` whose block <t>...</t> appears exactly once, non-empty, in order.

    1.0 exactly when the response is <t1>..</t1> ... <tn>..</tn>; partial credit lets a policy that starts
    from random weights find the grammar one block at a time.
    """
    scores = []
    for traj in trajectories:
        text, position, good = traj.text, 0, 0
        for tag in tags:
            blocks = list(re.finditer(_BLOCK.format(tag=tag), text, flags=re.S))
            if len(blocks) == 1 and blocks[0].group(1).strip() and blocks[0].start() >= position:
                good += 1
                position = blocks[0].end()
        scores.append(good / len(tags))
    return {"format": scores}


@register_reward("accuracy")
def accuracy(trajectories: list[Trajectory]) -> dict[str, list[float]]:
    """1 if the <answer> names the gold option (multiple choice) or equals the gold answer text, else 0."""
    scores = []
    for traj in trajectories:
        answer, task = extract_answer(traj.text), traj.task
        if answer is None:
            scores.append(0.0)
        elif task.get("options"):
            scores.append(float(extract_option(answer, task["options"]) == task["answer"].strip().upper()))
        else:
            gold = [task["answer"], *task.get("references", [])]
            scores.append(float(_normalise(answer) in {_normalise(g) for g in gold}))
    return {"accuracy": scores}

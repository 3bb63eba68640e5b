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


def option_letter(answer: str, options: dict[str, str]) -> str | None:
    """The option an answer names by its letter: "B", "(B)", "B) Marfan syndrome", "Option b"; else None."""
    m = re.match(rf"^\W*(?:option\s*)?([{''.join(options)}])(?:\W|$)", answer, flags=re.I)
    return m.group(1).upper() if m else None


def extract_option(answer: str, options: dict[str, str]) -> str | None:
    """The option letter an answer names: by its letter (`option_letter`) or by the option's text."""
    letter = option_letter(answer, options)
    if letter:
        return letter
    norm = _normalise(answer)
    hits = [k for k, v in options.items() if _normalise(v) == norm]
    return hits[0] if len(hits) == 1 else None


def _normalise(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


@register_reward("tag_format")
def tag_format(trajectories: list[Trajectory], tags: tuple[str, ...] = ("think", "answer")) -> dict[str, list[float]]:
    """Soft format score in [0, 1] for the grammar <t1>..</t1> ... <tn>..</tn>: each tag earns 1/2n when it appears
    exactly once, after the previous earned tag; a closing tag earns only if its opening tag did and the block
    between them is non-empty.

    1.0 exactly when the response follows the grammar. Partial credit per tag lets a policy that starts from
    random weights (writing a given tag in ~2% of samples) find the grammar step by step, and because a closing
    tag needs its opening tag, stray closing tags earn nothing.
    """
    scores = []
    for traj in trajectories:
        text, position, good = traj.text, 0, 0
        for tag in tags:
            opening, closing = f"<{tag}>", f"</{tag}>"
            start = text.find(opening, position)
            if text.count(opening) != 1 or start < 0:
                continue
            good, position = good + 1, start + len(opening)
            end = text.find(closing, position)
            if text.count(closing) == 1 and end >= 0 and text[position:end].strip():
                good, position = good + 1, end + len(closing)
        scores.append(good / (2 * len(tags)))
    return {"format": scores}


def answer_correct(traj: Trajectory) -> bool:
    """The <answer> names the gold option (multiple choice) or equals, normalised, the gold answer or a reference;
    for a ranked task, its first name does (top-1)."""
    answer, task = extract_answer(traj.text), traj.task
    if answer is None:
        return False
    if task.get("options"):
        return extract_option(answer, task["options"]) == task["answer"].strip().upper()
    if is_ranked(task):
        return answer_rank(traj) == 0
    return _normalise(answer) in _gold_texts(task)


#: How many names of a ranked answer count (top-3); further names are ignored, so listing more never helps.
RANKED_TOP = 3


def is_ranked(task: dict) -> bool:
    """An open question answered by a ranked list of up to RANKED_TOP names (real-case diagnosis)."""
    return (task.get("metadata") or {}).get("answer_type") == "ranked"


def ranked_answers(answer: str) -> list[str]:
    """The names a ranked answer lists, most likely first: separated by semicolons or lines, a leading "1." / "2)"
    / "-" dropped; only the first RANKED_TOP count."""
    names = [re.sub(r"^\s*(?:\d+\s*[.)]|[-*])\s*", "", part).strip() for part in re.split(r"[;\n]", answer)]
    return [n for n in names if n][:RANKED_TOP]


def answer_rank(traj: Trajectory) -> int | None:
    """Where the gold answer stands in a ranked <answer> (0: first), matched normalised against the gold name, its
    references (name variants, the disease id) and the metadata's disease_id; None if absent or unanswered."""
    answer = extract_answer(traj.text)
    if answer is None:
        return None
    disease_id = (traj.task.get("metadata") or {}).get("disease_id")
    gold = _gold_texts(traj.task) | ({_normalise(disease_id)} if disease_id else set())
    return next((i for i, name in enumerate(ranked_answers(answer)) if _normalise(name) in gold), None)


def _gold_texts(task: dict) -> set[str]:
    return {_normalise(g) for g in [task["answer"], *task.get("references", [])]}


@register_reward("accuracy")
def accuracy(trajectories: list[Trajectory]) -> dict[str, list[float]]:
    """1 if the <answer> names the gold option (multiple choice), equals the gold answer text, or (a ranked task)
    puts the gold first, else 0."""
    return {"accuracy": [float(answer_correct(t)) for t in trajectories]}


@register_reward("valid_option")
def valid_option(trajectories: list[Trajectory]) -> dict[str, list[float]]:
    """1 if the <answer> of a multiple-choice task names one of its options (right or wrong), else 0: the
    answer-format half of MCQ accuracy, so a policy learns to choose before it learns to choose well."""
    return {"valid_option": [float(chosen_option(t) is not None) for t in trajectories]}


def chosen_option(traj: Trajectory) -> str | None:
    """The option letter the <answer> of a multiple-choice episode names, or None (no options, no answer, no option)."""
    answer, options = extract_answer(traj.text), traj.task.get("options")
    return extract_option(answer, options) if options and answer is not None else None


@register_reward("grounded_option")
def grounded_option(trajectories: list[Trajectory]) -> dict[str, list[float]]:
    """1 if the <answer> of a multiple-choice task names an option that one of the episode's searches linked (a hit
    titled with that option's text, shown "(option X)": `retrieval.link_options`, recorded in each turn's `linked`),
    else 0: an answer the retrieved evidence supports. Guessing without a search, or from hits that name no option,
    earns nothing, so searching on (a later page) until the evidence names a candidate pays."""
    scores = []
    for traj in trajectories:
        letter, linked = chosen_option(traj), {option for turn in traj.turns for option in turn.get("linked", [])}
        scores.append(float(letter is not None and letter in linked))
    return {"grounded_option": scores}

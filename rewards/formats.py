"""The recipes' format rewards, each a tag grammar: Med-RwR's think/retrieval bonus, Med-R3's strict grammar with no
duplicate tags, MedVistaGym's think -> tool_call -> think -> answer order. Tag names are arguments."""
from __future__ import annotations

import json
import re

from actors.trajectory import Trajectory
from rewards.builtin import answer_correct
from rewards.registry import register_reward


def follows_grammar(text: str, tags: list[str], grammar: str, free_gaps: tuple[tuple[str, str], ...] = ()) -> bool:
    """True if (1) the sequence of markers <t> / </t> of `tags` in `text` fully matches `grammar`, a regex over
    those markers written one after another; (2) text outside every block is whitespace, except between the marker
    pairs in `free_gaps` (where the environment writes, e.g. a tool observation after </tool_call>); (3) every
    top-level block has non-whitespace content. Text inside a block is free (nested blocks included)."""
    markers = list(re.finditer("</?(?:{})>".format("|".join(map(re.escape, tags))), text))
    if not re.fullmatch(grammar, "".join(m.group() for m in markers)):
        return False
    depth, previous, previous_end, block_start = 0, None, 0, 0
    for m in markers:
        closing = m.group().startswith("</")
        gap = text[previous_end:m.start()]
        if depth == 0 and gap.strip() and (previous, m.group()) not in free_gaps:
            return False
        if depth == 1 and closing and not text[block_start:m.start()].strip():
            return False
        if depth == 0:
            block_start = m.end()
        depth += -1 if closing else 1
        previous, previous_end = m.group(), m.end()
    return not text[previous_end:].strip()


def med_rwr_format_score(text: str, retrieved: bool, correct: bool, think: str = "think") -> float:
    """Med-RwR's format reward (the Med-RwR paper, sec. 3.2): 1 if the output has a thinking process (a
    non-empty <think> block), plus 1 more when retrieval was used and the answer is correct; 0 without thinking."""
    thinking = re.search(rf"<{think}>\s*\S.*?</{think}>", text, flags=re.S) is not None
    return float(thinking) * (1.0 + float(retrieved and correct))


@register_reward("med_rwr_format")
def med_rwr_format(trajectories: list[Trajectory], think: str = "think") -> dict[str, list[float]]:
    """Med-RwR's format reward; retrieval was used when a turn carries a "query"."""
    return {"format": [med_rwr_format_score(t.text, any("query" in turn for turn in t.turns), answer_correct(t), think)
                       for t in trajectories]}


def med_r3_grammar(think: str, answer: str, retrieval: list[str]) -> tuple[list[str], str]:
    """Med-R3's grammar (the Med-R3 paper, sec. "Format"): <think>...</think><answer>...</answer>, each once
    ("no duplicate tags"), with any number of <search>...</search><document>...</document> rounds inside the think
    block (the model searches while thinking; the environment writes the document). retrieval=[] gives the plain
    think-then-answer grammar, e.g. ARMed's Rf."""
    rounds = "".join(f"<{t}></{t}>" for t in retrieval)
    return [think, answer, *retrieval], f"<{think}>(?:{rounds})*</{think}><{answer}></{answer}>"


@register_reward("med_r3_format")
def med_r3_format(trajectories: list[Trajectory], think: str = "think", answer: str = "answer",
                  retrieval: tuple[str, ...] = ("search", "document")) -> dict[str, list[float]]:
    """1 if the response follows Med-R3's grammar exactly, else 0."""
    tags, grammar = med_r3_grammar(think, answer, list(retrieval))
    return {"format": [float(follows_grammar(t.text, tags, grammar)) for t in trajectories]}


def medvista_format_ok(text: str, think: str = "think", tool_call: str = "tool_call", answer: str = "answer",
                       min_tool_calls: int = 1) -> bool:
    """MedVistaGym's format (the MedVistaGym paper, appendix C): <think></think> then, per tool call,
    <tool_call>{json}</tool_call> followed by the environment's observation and a new <think></think>, and finally
    <answer></answer>; every tool call a JSON object; at least `min_tool_calls` calls (the paper's order has one)."""
    grammar = (f"<{think}></{think}>(?:<{tool_call}></{tool_call}><{think}></{think}>)"
               f"{{{min_tool_calls},}}<{answer}></{answer}>")
    if not follows_grammar(text, [think, tool_call, answer], grammar, free_gaps=((f"</{tool_call}>", f"<{think}>"),)):
        return False
    try:
        calls = [json.loads(c) for c in re.findall(rf"<{tool_call}>(.*?)</{tool_call}>", text, flags=re.S)]
    except json.JSONDecodeError:
        return False
    return all(isinstance(c, dict) for c in calls)


@register_reward("medvista_format")
def medvista_format(trajectories: list[Trajectory], think: str = "think", tool_call: str = "tool_call",
                    answer: str = "answer", min_tool_calls: int = 1) -> dict[str, list[float]]:
    """1 if the response follows MedVistaGym's format, else 0."""
    return {"format": [float(medvista_format_ok(t.text, think, tool_call, answer, min_tool_calls))
                       for t in trajectories]}


def is_repetitive(text: str, observation: str = "tool_response", ngram: int = 8, repeats: int = 3) -> bool:
    """True if some run of `ngram` words the policy wrote occurs `repeats` or more times: the degenerate loops a
    sampled policy falls into. Text inside <observation> blocks is the environment's and is left out."""
    own = re.sub(rf"<{observation}>.*?</{observation}>", " ", text, flags=re.S).split()
    counts: dict[tuple[str, ...], int] = {}
    for i in range(len(own) - ngram + 1):
        key = tuple(own[i:i + ngram])
        counts[key] = counts.get(key, 0) + 1
        if counts[key] >= repeats:
            return True
    return False


@register_reward("medvista_accuracy")
def medvista_accuracy(trajectories: list[Trajectory], think: str = "think", tool_call: str = "tool_call",
                      answer: str = "answer", observation: str = "tool_response", min_tool_calls: int = 1,
                      ngram: int = 8, repeats: int = 3) -> dict[str, list[float]]:
    """MedVistaGym's gated accuracy (the MedVistaGym paper, sec. 3.2): 1 only if the response is well-formed
    (MedVistaGym's format), free of repetitive generation and its answer is correct; plain correctness is logged
    as `metric/ungated_accuracy`."""
    correct = [answer_correct(t) for t in trajectories]
    gated = [float(ok and medvista_format_ok(t.text, think, tool_call, answer, min_tool_calls)
                   and not is_repetitive(t.text, observation, ngram, repeats))
             for t, ok in zip(trajectories, correct)]
    return {"accuracy": gated, "metric/ungated_accuracy": [float(ok) for ok in correct]}

"""Judge-graded accuracy of open questions at evaluation (`eval.judge: true`, or `--judge` on learners.evaluate).

Text similarity (BLEU-1, ROUGE-1, BERTScore, CosSim) says how close an open answer is to the gold one, not whether it
is right. With a judge, the JudgeActor (the config's `judge` section: a vLLM engine or an OpenAI-compatible
endpoint) reads each open answer beside the question and the gold answer and says "correct" or "incorrect"; the share
judged correct is `judge_accuracy`, with its 95% Wilson interval, over every open question. An episode without an
<answer> is incorrect without asking; a verdict that does not parse after the judge's retries counts as incorrect and
is reported in `judge_parse_failures`, so a judge that cannot follow the format shows in the report.
"""
from __future__ import annotations

import ray

from actors.trajectory import Trajectory
from learners.intervals import wilson_interval
from rewards.builtin import extract_answer
from rewards.judge import check_template, question_text, reference_answer_text

VERDICT_PROMPT = """You judge whether the answer to a medical question is correct, against the reference answer.

Question:
{question}

Reference answer: {reference}

Answer to judge: {answer}

The answer is correct if it means the same as the reference (synonyms, paraphrases and agreeing detail count); \
otherwise it is incorrect.
Reply with one word, correct or incorrect, alone on the last line."""


def verdict_prompts(trajectories: list[Trajectory], prompt: str = VERDICT_PROMPT) -> tuple[list[int], list[str]]:
    """The indices of the episodes with an <answer>, and one judge prompt for each."""
    check_template(prompt, {"question", "reference", "answer"}, "eval judge prompt")
    answers = [extract_answer(t.text) for t in trajectories]
    asked = [i for i, a in enumerate(answers) if a]
    return asked, [prompt.format(question=question_text(trajectories[i].task), answer=answers[i],
                                 reference=reference_answer_text(trajectories[i].task)) for i in asked]


def verdict_counts(n: int, verdicts: list[bool | None]) -> dict:
    """`judge_accuracy` (correct over all `n` open questions, with its 95% Wilson interval and the counts behind it)
    and `judge_parse_failures`, from the verdicts of the answered ones (None: did not parse)."""
    correct, failures = sum(v is True for v in verdicts), sum(v is None for v in verdicts)
    low, high = wilson_interval(correct, n)
    return {"judge_accuracy": {"mean": correct / n if n else 0.0, "low": low, "high": high, "n": n,
                               "correct": correct, "incorrect": sum(v is False for v in verdicts),
                               "unanswered": n - len(verdicts), "parse_failures": failures},
            "judge_parse_failures": failures}


def judge_open_answers(open_ended: list[Trajectory], judge) -> dict:
    """The judge's verdicts on the episodes of open questions `open_ended` (`learners.evaluate.open_questions`:
    multiple choice and closed questions are left to exact match), all prompts in one call to the JudgeActor handle
    `judge`, as `verdict_counts`; {} when there are none."""
    if not open_ended:
        return {}
    _, contents = verdict_prompts(open_ended)
    verdicts = ray.get(judge.judge.remote([[{"role": "user", "content": c}] for c in contents], "verdict")) \
        if contents else []
    return verdict_counts(len(open_ended), verdicts)

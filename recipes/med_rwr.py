"""Med-RwR's plugin (the Med-RwR paper): the confidence-gain probe, a rollout hook.

The confidence-gain reward (rewards/confidence.py, sec. 3.2.2, Eqn. 3) compares log p(gold answer) right after the
policy's `<answer>` with and without the retrieved text, the gold answer written as the policy writes its own (the
option's letter, or its text). The rollout worker that sampled the episode reads both, right
after the rollout, as prompt log-probabilities of two sequences (one batched prefill under the behaviour policy's
weights), and stores them in `Trajectory.answer_logprobs`; only stages whose rewards include confidence_gain pay for
the probes. CDIR (confidence-driven image re-retrieval) is an evaluation and serving feature: actors/cdir.py.

    recipe: med_rwr
"""
from __future__ import annotations

from actors.hooks import RolloutHook
from actors.trajectory import Trajectory
from recipes import Recipe, register_recipe
from rewards.builtin import extract_answer, option_letter


def gold_as_written(task: dict, answer: str | None) -> str:
    """The gold answer in the form of the policy's own `answer`: the gold option's text where the policy answered a
    multiple-choice task with text rather than a letter, else the task's answer (the letter)."""
    options = task.get("options")
    if options and answer and option_letter(answer, options) is None:
        return options[task["answer"]]
    return str(task.get("answer", ""))


def answer_probe_sequences(prompt_ids: list[int], response_ids: list[int], loss_mask: list[int],
                           answer_open: list[int], gold_ids: list[int]) -> tuple[list[int], list[int]] | None:
    """(with retrieval, without retrieval) token sequences ending in the gold answer's tokens placed right after the
    policy's last `<answer>` (`answer_open`: the tag's token ids, one special token or several ordinary ones); None
    when the policy wrote no `<answer>` or the environment inserted nothing."""
    n = len(answer_open)
    ends = [i + n for i in range(len(response_ids) - n + 1)
            if response_ids[i:i + n] == answer_open and all(loss_mask[i:i + n])]
    if not ends or all(loss_mask):
        return None
    upto = ends[-1]
    with_k = prompt_ids + response_ids[:upto] + gold_ids
    without_k = prompt_ids + [t for t, m in zip(response_ids[:upto], loss_mask[:upto]) if m] + gold_ids
    return with_k, without_k


class AnswerProbe(RolloutHook):
    """Fills `answer_logprobs` of every trajectory that retrieved and answered."""

    def finish(self, worker, trajectories: list[Trajectory]) -> dict[str, float]:
        tokenizer = worker.tokenizer
        answer_open = tokenizer.encode(f"<{worker.runner.grammar.answer_tag}>", add_special_tokens=False)
        probes, images, owners, lengths = [], [], [], []
        for t in trajectories:
            t.answer_logprobs = {}  # probed: empty unless the episode retrieved and answered
            gold = tokenizer.encode(gold_as_written(t.task, extract_answer(t.text)), add_special_tokens=False)
            pair = answer_probe_sequences(t.prompt_ids, t.response_ids, t.loss_mask, answer_open, gold) \
                if gold else None
            if pair:
                probes += pair
                images += [t.images, t.images[:len(t.task.get("images") or [])]]
                owners.append(t)
                lengths += [len(gold)] * 2
        if probes:  # log p(gold answer): the sum over its tokens
            gold_logp = [sum(lps[-n:]) for lps, n in zip(worker.prompt_logprobs(probes, images), lengths)]
            for i, t in enumerate(owners):
                t.answer_logprobs = {"with": gold_logp[2 * i], "without": gold_logp[2 * i + 1]}
        return {"med_rwr/probed": len(owners)}


@register_recipe("med_rwr")
class MedRwR(Recipe):
    """The answer probe in every GRPO stage that rewards confidence gain."""

    def rollout_hooks(self, cfg) -> list[RolloutHook]:
        return [AnswerProbe()] if any(c.name == "confidence_gain" for c in cfg.rewards.components) else []

"""Med-RwR's plugin (the Med-RwR paper): the confidence-gain probe, a rollout hook.

The confidence-gain reward (rewards/confidence.py, sec. 3.2.2, Eqn. 3) compares log p(gold option) right after the
policy's `<answer>` with and without the retrieved text. The rollout worker that sampled the episode reads both, right
after the rollout, as prompt log-probabilities of two sequences (one batched prefill under the behaviour policy's
weights), and stores them in `Trajectory.answer_logprobs`; only stages whose rewards include confidence_gain pay for
the probes. CDIR (confidence-driven image re-retrieval) is an evaluation and serving feature: actors/cdir.py.

    recipe: med_rwr
"""
from __future__ import annotations

from actors.hooks import RolloutHook
from actors.trajectory import Trajectory
from recipes import Recipe, register_recipe


def answer_probe_sequences(prompt_ids: list[int], response_ids: list[int], loss_mask: list[int],
                           answer_open: list[int], gold_id: int) -> tuple[list[int], list[int]] | None:
    """(with retrieval, without retrieval) token sequences ending in the gold answer token placed right after the
    policy's last `<answer>` (`answer_open`: the tag's token ids, one special token or several ordinary ones); None
    when the policy wrote no `<answer>` or the environment inserted nothing."""
    n = len(answer_open)
    ends = [i + n for i in range(len(response_ids) - n + 1)
            if response_ids[i:i + n] == answer_open and all(loss_mask[i:i + n])]
    if not ends or all(loss_mask):
        return None
    upto = ends[-1]
    with_k = prompt_ids + response_ids[:upto] + [gold_id]
    without_k = prompt_ids + [t for t, m in zip(response_ids[:upto], loss_mask[:upto]) if m] + [gold_id]
    return with_k, without_k


class AnswerProbe(RolloutHook):
    """Fills `answer_logprobs` of every trajectory that retrieved and answered."""

    def finish(self, worker, trajectories: list[Trajectory]) -> dict[str, float]:
        tokenizer = worker.tokenizer
        answer_open = tokenizer.encode(f"<{worker.runner.grammar.answer_tag}>", add_special_tokens=False)
        probes, images, owners = [], [], []
        for t in trajectories:
            t.answer_logprobs = {}  # probed: empty unless the episode retrieved and answered
            gold = tokenizer.encode(str(t.task.get("answer", "")), add_special_tokens=False)
            pair = answer_probe_sequences(t.prompt_ids, t.response_ids, t.loss_mask, answer_open, gold[0]) \
                if gold else None
            if pair:
                probes += pair
                images += [t.images, t.images[:len(t.task.get("images") or [])]]
                owners.append(t)
        if probes:
            last = [lps[-1] for lps in worker.prompt_logprobs(probes, images)]
            for i, t in enumerate(owners):
                t.answer_logprobs = {"with": last[2 * i], "without": last[2 * i + 1]}
        return {"med_rwr/probed": len(owners)}


@register_recipe("med_rwr")
class MedRwR(Recipe):
    """The answer probe in every GRPO stage that rewards confidence gain."""

    def rollout_hooks(self, cfg) -> list[RolloutHook]:
        return [AnswerProbe()] if any(c.name == "confidence_gain" for c in cfg.rewards.components) else []

"""Med-RwR's confidence-gain reward (the Med-RwR paper, sec. 3.2.2, Eqn. 3).

    sigma_c = log pi_theta(gold | x, y_<=tau, h, k) - log pi_theta(gold | x, y_<=tau)

read at the position right after the trajectory's `<answer>` tag (tau), under the current policy: once with the
whole episode as context (reasoning history h and retrieved knowledge k), once with every token the environment
inserted removed (the policy's own reasoning and queries kept, the retrieved text k gone), so the difference is what
the retrieved knowledge did to the policy's confidence in the right option.

Where it is computed: by the rollout engine that sampled the episode, right after the rollout, as prompt
log-probabilities of those two sequences (one batched prefill on weights that are, by construction, the behaviour
policy's; a learner forward would need the sequences shipped to the learner and a second pass there). The rollout
worker stores them in `Trajectory.answer_logprobs`; the reward below only reads them.
"""
from __future__ import annotations

from actors.trajectory import Trajectory
from rewards.registry import register_reward


def answer_probe_sequences(prompt_ids: list[int], response_ids: list[int], loss_mask: list[int],
                           answer_open_id: int, gold_id: int) -> tuple[list[int], list[int]] | None:
    """(with retrieval, without retrieval) token sequences ending in the gold answer token placed right after the
    policy's last `<answer>`; None when the policy wrote no `<answer>` or the environment inserted nothing."""
    opens = [i for i, (t, m) in enumerate(zip(response_ids, loss_mask)) if t == answer_open_id and m]
    if not opens or all(loss_mask):
        return None
    upto = opens[-1] + 1
    with_k = prompt_ids + response_ids[:upto] + [gold_id]
    without_k = prompt_ids + [t for t, m in zip(response_ids[:upto], loss_mask[:upto]) if m] + [gold_id]
    return with_k, without_k


def confidence_gain_value(answer_logprobs: dict | None) -> float:
    """sigma_c from the two log-probabilities; 0 for an episode without retrieval or without an answer."""
    if not answer_logprobs:
        return 0.0
    return answer_logprobs["with"] - answer_logprobs["without"]


@register_reward("confidence_gain")
def confidence_gain(trajectories: list[Trajectory]) -> dict[str, list[float]]:
    """Med-RwR's sigma_c per trajectory (weight 5 in the paper's total)."""
    return {"confidence_gain": [confidence_gain_value(t.answer_logprobs) for t in trajectories]}


#: The rollout workers compute `Trajectory.answer_logprobs` only when a run's rewards read them.
confidence_gain.needs_answer_logprobs = True

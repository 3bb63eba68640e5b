"""Med-RwR's confidence-gain reward (the Med-RwR paper, sec. 3.2.2, Eqn. 3).

    sigma_c = log pi_theta(gold | x, y_<=tau, h, k) - log pi_theta(gold | x, y_<=tau)

read at the position right after the trajectory's `<answer>` tag (tau), under the current policy: once with the
whole episode as context (reasoning history h and retrieved knowledge k), once with every token the environment
inserted removed (the policy's own reasoning and queries kept, the retrieved text k gone), so the difference is what
the retrieved knowledge did to the policy's confidence in the right option (its letter, or its text where the
policy answers with text: log p summed over the answer's tokens).

Where it is computed: by the rollout engine that sampled the episode, right after the rollout, as prompt
log-probabilities of those two sequences (one batched prefill on weights that are, by construction, the behaviour
policy's; a learner forward would need the sequences shipped to the learner and a second pass there): the med_rwr
recipe's rollout hook (recipes/med_rwr.py) stores them in `Trajectory.answer_logprobs` in every stage whose rewards
include confidence_gain; the reward below only reads them, and refuses trajectories no probe has seen (a run without
that recipe) rather than scoring them 0.
"""
from __future__ import annotations

from actors.trajectory import Trajectory
from rewards.registry import register_reward


def confidence_gain_value(answer_logprobs: dict | None) -> float:
    """sigma_c from the two log-probabilities; 0 for an episode without retrieval or without an answer."""
    if not answer_logprobs:
        return 0.0
    return answer_logprobs["with"] - answer_logprobs["without"]


@register_reward("confidence_gain")
def confidence_gain(trajectories: list[Trajectory]) -> dict[str, list[float]]:
    """Med-RwR's sigma_c per trajectory (weight 5 in the paper's total)."""
    if any(t.answer_logprobs is None for t in trajectories):
        raise ValueError("confidence_gain needs the answer log-probabilities the med_rwr recipe's rollout hook reads; "
                         "add `recipe: med_rwr` to the config")
    return {"confidence_gain": [confidence_gain_value(t.answer_logprobs) for t in trajectories]}

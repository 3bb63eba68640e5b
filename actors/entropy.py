"""Token entropy from the engine's top-k log-probabilities, recorded per policy token when a rollout hook asks for
it (`RolloutHook.top_logprobs`).

The engine returns the top-k log-probabilities of each sampled position (after temperature,
`logprobs_mode=processed_logprobs`); the mass r outside the top k is taken as spread evenly over the other V - k
tokens: H ~= -sum_topk p log p - r log(r / (V - k)). With k >= V it is exact.
"""
from __future__ import annotations

import math


def topk_entropy(logprobs: list[float], vocab_size: int) -> float:
    """Entropy (nats) of a next-token distribution known through its top-k log-probabilities; the remaining mass is
    assumed uniform over the other vocab_size - k tokens."""
    probs = [math.exp(lp) for lp in logprobs]
    h = -sum(p * lp for p, lp in zip(probs, logprobs) if p > 0)
    rest, others = max(0.0, 1.0 - sum(probs)), vocab_size - len(logprobs)
    if rest > 1e-12 and others > 0:
        h -= rest * math.log(rest / others)
    return h

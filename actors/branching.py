"""MedVR's Entropy-guided Visual Regrounding (EVR, the MedVR paper, sec. 3.2 and Algorithm 1): where a
rollout is uncertain about a tool's arguments, fork it and sample those arguments again.

    H_t   = - sum_v p_t(v) log p_t(v)                   token entropy at temperature T
    H_base = mean H_t over the first `base_tokens` tokens of the response
    H_tool = rolling mean of H_t over the last `window` tool-argument tokens
    P      = P_base + gamma * (H_tool - H_base)          (P_base 0.5, gamma 0.5), clipped to [0, 1]

Half of each prompt's G rollouts are generated first (the base set); while a base rollout decodes a tool call's
arguments, a branch event fires at a token with probability P and forks the rollout there (the shared prefix is
reused through vLLM's prefix cache; the branch samples the arguments anew), spending one unit of the reserved half.
At most one fork per tool call. Budget left when the base set is done is spent on independent samples.

Decisions are made after the base set is generated, from the entropies recorded while decoding, walking the base
rollouts in order: a decision at token t depends only on the entropies up to t and its own uniform draw, so this is
the same process as deciding during decoding (only the order in which concurrent rollouts claim the budget is fixed
rather than timing-dependent, which keeps runs reproducible).

Entropy source: the engine returns the top-k log-probabilities of each sampled position (after temperature,
`logprobs_mode=processed_logprobs`); the mass r outside the top k is taken as spread evenly over the other V - k
tokens, H ~= -sum_topk p log p - r log(r / (V - k)). With k >= V it is exact.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field


class EVRConfig(BaseModel):
    """`rollout.evr`: MedVR's entropy-guided branching (off unless enabled)."""
    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    p_base: float = Field(0.5, ge=0, le=1)
    gamma: float = Field(0.5, ge=0)
    base_tokens: int = Field(16, ge=1, description="H_base: mean entropy over the response's first tokens")
    window: int = Field(4, ge=1, description="H_tool: rolling mean over the last tool-argument tokens")
    top_logprobs: int = Field(20, ge=1, le=20, description="log-probabilities per position the entropy is computed "
                                                        "from (vLLM returns at most 20 by default)")


def topk_entropy(logprobs: list[float], vocab_size: int) -> float:
    """Entropy (nats) of a next-token distribution known through its top-k log-probabilities; the remaining mass is
    assumed uniform over the other vocab_size - k tokens."""
    probs = [math.exp(lp) for lp in logprobs]
    h = -sum(p * lp for p, lp in zip(probs, logprobs) if p > 0)
    rest, others = max(0.0, 1.0 - sum(probs)), vocab_size - len(logprobs)
    if rest > 1e-12 and others > 0:
        h -= rest * math.log(rest / others)
    return h


def branch_probability(h_tool: float, h_base: float, p_base: float, gamma: float) -> float:
    """P = P_base + gamma * (H_tool - H_base), clipped to a probability."""
    return min(1.0, max(0.0, p_base + gamma * (h_tool - h_base)))


def argument_spans(response_ids: list[int], loss_mask: list[int], open_id: int, close_id: int,
                   decode=None, key: str = '"arguments"') -> list[range]:
    """Token positions inside each action block the policy wrote (between its <tool_call> and </tool_call>
    tokens), where a fork may happen. With `decode` (token ids -> text), a block that names `key` starts after the
    token that completes it, so forks resample the arguments (the zoom box's coordinates), not the tool's name."""
    spans, start = [], None
    for i, (token, by_policy) in enumerate(zip(response_ids, loss_mask)):
        if not by_policy:
            continue
        if token == open_id:
            start = i + 1
        elif token == close_id and start is not None:
            if decode is not None:
                start = next((j + 1 for j in range(start, i) if key in decode(response_ids[start:j + 1])), start)
            if i > start:
                spans.append(range(start, i))
            start = None
    return spans


@dataclass(frozen=True)
class Fork:
    episode: int        # index of the base rollout forked
    position: int       # response token index where the branch starts sampling anew
    probability: float  # P at that token


def plan_forks(entropies: list[list[float]], spans: list[list[range]], budget: int, cfg: EVRConfig,
               rng: random.Random) -> list[Fork]:
    """Walk the base rollouts in order and their tool calls' argument tokens in order; at each token fire with
    probability P (at most one fork per tool call) until `budget` forks are planned."""
    forks: list[Fork] = []
    for episode, (h, calls) in enumerate(zip(entropies, spans)):
        h_base = sum(h[:cfg.base_tokens]) / max(1, len(h[:cfg.base_tokens]))
        for call in calls:
            for t in call:
                if len(forks) == budget:
                    return forks
                recent = h[max(call.start, t - cfg.window + 1):t + 1]
                p = branch_probability(sum(recent) / len(recent), h_base, cfg.p_base, cfg.gamma)
                if rng.random() < p:
                    forks.append(Fork(episode, t, p))
                    break
    return forks

"""MedVR's plugin: Entropy-guided Visual Regrounding (EVR, the MedVR paper, sec. 3.2 and Algorithm 1), a rollout
hook: where a rollout is uncertain about a tool's arguments, fork it and sample those arguments again.

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

Entropy source: the engine's top-k log-probabilities of each sampled position (actors/entropy.py).

    recipe: {name: medvr, args: {evr: {p_base: 0.5, gamma: 0.5}}}     # evr.enabled false: the ablation
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from actors.episode import Episode, derive_seed
from actors.hooks import RolloutBatch, RolloutHook
from recipes import Recipe, register_recipe


class EVRConfig(BaseModel):
    """`recipe.args.evr`: the branching's settings."""
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="false: every sample independent (the ablation without EVR)")
    p_base: float = Field(0.5, ge=0, le=1)
    gamma: float = Field(0.5, ge=0)
    base_tokens: int = Field(16, ge=1, description="H_base: mean entropy over the response's first tokens")
    window: int = Field(4, ge=1, description="H_tool: rolling mean over the last tool-argument tokens")
    top_logprobs: int = Field(20, ge=1, le=20, description="log-probabilities per position the entropy is computed "
                                                        "from (vLLM returns at most 20 by default)")


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


class EVRBranching(RolloutHook):
    """EVR inside the rollout worker: half of each group first (the base set), with token entropies recorded; then
    per group the forks planned from the base rollouts' tool-argument entropies, and independent samples for the
    budget left. Groups end as base rollouts, then forks, then the independent ones."""

    def __init__(self, cfg: EVRConfig):
        self.cfg = cfg
        self.top_logprobs = cfg.top_logprobs

    def base_samples(self, group_size: int) -> int:
        return group_size - group_size // 2

    def extend(self, worker, batch: RolloutBatch) -> tuple[list[Episode], dict[str, float]]:
        g, tokenizer, vision = worker.runner.grammar, worker.tokenizer, worker.vision
        open_id, close_id = (tokenizer.convert_tokens_to_ids(t) for t in (f"<{g.action_tag}>", g.action_close))
        if tokenizer.unk_token_id in (open_id, close_id) or None in (open_id, close_id):
            raise ValueError(f"medvr: EVR finds tool calls by their tags, but this tokenizer has no single token for "
                             f"<{g.action_tag}> or {g.action_close} (rollout.grammar.action_tag)")
        budget = batch.group_size - self.base_samples(batch.group_size)
        extra, forks = [], 0
        for i, group in enumerate(batch.groups):
            rng = random.Random(derive_seed(batch.seed, group[0].group, "evr"))
            spans = [argument_spans(ep.response_ids, ep.loss_mask, open_id, close_id, tokenizer.decode)
                     for ep in group]
            planned = plan_forks([ep.entropies for ep in group], spans, budget, self.cfg, rng)
            for k, fork in enumerate(planned):
                origin = group[fork.episode]  # it keeps its prompt's images and those observed before the fork
                shown = batch.prompt_images[i] + (origin.response_ids[:fork.position].count(vision.start_id)
                                                  if vision else 0)
                branch = origin.fork(fork.position, derive_seed(batch.seed, group[0].group, "fork", k), shown)
                branch.branch = {"of": fork.episode, "at": fork.position, "p": round(fork.probability, 4)}
                group.append(branch)
            group += [batch.new_episode(i, len(group) + k) for k in range(budget - len(planned))]
            extra += group[len(group) - budget:]
            forks += len(planned)
        return extra, {"evr/branch_events": forks, "evr/branch_budget": budget * len(batch.groups)}


class MedVRArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    evr: EVRConfig = EVRConfig()


@register_recipe("medvr")
class MedVR(Recipe):
    """EVR branching in every GRPO stage (the CCA tool reward is `medvr_tool`, rewards/tool_use.py)."""
    Args = MedVRArgs

    def check(self, cfg) -> None:
        if self.args.evr.enabled and (not cfg.rollout.grammar.action_tag or cfg.rollout.group_size < 2):
            raise ValueError("recipe.args.evr needs a grammar with an action tag (tool calls to branch in) and "
                             "group_size >= 2 (half of each group is the base set, half the branching budget)")

    def rollout_hooks(self, cfg) -> list[RolloutHook]:
        return [EVRBranching(self.args.evr)] if self.args.evr.enabled else []

"""Turn and token budgets the environment cannot honour, refused when the config is read: each message names the field
to change. RunConfig (learners/config.py) runs `check_budgets` on the run's config and on every stage's.

What an episode spends (actors/environment.py:EpisodeRunner): the prompt (at most data.max_prompt_tokens), then
generation turns of at most rollout.max_new_tokens, each action answered by an observation cut to
rollout.grammar.max_observation_tokens, all within rollout.grammar.max_response_tokens after the prompt and
rollout.grammar.max_turns environment calls; the engine holds prompt and response within rollout.max_model_len.
"""
from __future__ import annotations

import math

#: The most characters one token of prose spans, so that characters / this is a floor on a passage's tokens: BPE
#: vocabularies average ~4 characters per token on English and the tiny HPO tokenizer fewer, so twice that keeps
#: the floor below any real passage's tokens.
MAX_CHARS_PER_TOKEN = 8


def turn_problem(cfg) -> str | None:
    """With an action tag, an episode needs one environment call to search (or call a tool) and then answer:
    rollout.grammar.max_turns, and eval.max_turns when set, must be at least 1."""
    if not cfg.rollout.grammar.action_tag:
        return None
    limits = {"rollout.grammar.max_turns": cfg.rollout.grammar.max_turns,
              "eval.max_turns": cfg.eval.max_turns if cfg.eval is not None else None}
    for field, turns in limits.items():
        if turns is not None and turns < 1:
            return (f"{field} {turns} allows no environment call: the policy's first <{cfg.rollout.grammar.action_tag}>"
                    f" would end the episode before it answers; set it to at least 1 (or rollout.grammar.action_tag "
                    f"to null for single-turn episodes)")
    return None


def response_problem(cfg) -> str | None:
    """With an action tag, rollout.grammar.max_response_tokens must hold a search and an answer: a full generation turn,
    a full observation, and a full answer turn (2 x rollout.max_new_tokens + max_observation_tokens)."""
    g, turn = cfg.rollout.grammar, cfg.rollout.max_new_tokens
    need = 2 * turn + g.max_observation_tokens
    if g.action_tag and g.max_response_tokens < need:
        return (f"rollout.grammar.max_response_tokens {g.max_response_tokens} cannot hold a search and an answer: a "
                f"turn (rollout.max_new_tokens {turn}), its observation (rollout.grammar.max_observation_tokens "
                f"{g.max_observation_tokens}) and the answer turn ({turn}) need {need}; raise it or lower those")
    return None


def context_problem(cfg) -> str | None:
    """rollout.max_model_len must hold the longest prompt (data.max_prompt_tokens) and its response: the grammar's
    max_response_tokens, or one turn of max_new_tokens (if smaller) without an action tag. A longer episode would be
    cut by the engine, not by the grammar."""
    g = cfg.rollout.grammar
    response = g.max_response_tokens if g.action_tag else min(cfg.rollout.max_new_tokens, g.max_response_tokens)
    need = cfg.data.max_prompt_tokens + response
    if cfg.rollout.max_model_len < need:
        return (f"rollout.max_model_len {cfg.rollout.max_model_len} cannot hold a prompt (data.max_prompt_tokens "
                f"{cfg.data.max_prompt_tokens}) and its response ({response} tokens: rollout.grammar."
                f"{'max_response_tokens' if g.action_tag else 'max_new_tokens'}): raise it to {need} or lower those")
    return None


def observation_problem(cfg) -> str | None:
    """Retrieved passages cut to retrieval.passage_chars characters take at least passage_chars / MAX_CHARS_PER_TOKEN
    tokens each: rollout.grammar.max_observation_tokens below that cuts every hit, the first one included."""
    r, g = cfg.retrieval, cfg.rollout.grammar
    if r is None or not g.action_tag or r.show != "passages" or r.passage_chars is None:
        return None
    floor = math.ceil(r.passage_chars / MAX_CHARS_PER_TOKEN)
    if g.max_observation_tokens < floor:
        return (f"rollout.grammar.max_observation_tokens {g.max_observation_tokens} cuts every hit: one passage of "
                f"retrieval.passage_chars {r.passage_chars} characters takes at least {floor} tokens; raise it or "
                f"lower retrieval.passage_chars")
    return None


def check_budgets(cfg) -> None:
    """Raise ValueError naming the field of the first budget the environment cannot honour (turns, response tokens,
    the engine's context, observations); `cfg` is a RunConfig."""
    for check in (turn_problem, response_problem, context_problem, observation_problem):
        problem = check(cfg)
        if problem:
            raise ValueError(problem)

"""Agent mode: the medical reasoning-with-retrieval loop on a served request.

The same grammar as training (`actors.environment.Grammar`): the model writes until it closes the action tag
(`</query>`), the query goes to the retriever, the hits come back inside the observation tag (`<retrieve>...`) and the
model continues, until it closes `</answer>`, runs out of turns or of its token budget.
"""
from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from actors.environment import Grammar, retrieval_text, turn_seed

# (prompt ids, max_tokens, stop strings, seed) -> (text, token ids, stop string that ended it or None)
Generate = Callable[[list[int], int, list[str], int | None], Awaitable[tuple[str, list[int], str | None]]]
# (queries, top_k) -> hits per query, each a dict with at least "id" and "text"
Search = Callable[[list[str], int], Awaitable[list[list[dict]]]]


@dataclass
class AgentResult:
    answer: str | None
    finish: str                                     # answer, turn_limit, budget, length, stop
    transcript: str                                 # everything after the prompt: the model's and the retriever's
    completion_tokens: int                          # tokens the model wrote
    turns: list[dict] = field(default_factory=list)  # per retrieval: query, chunk ids, error

    def trace(self) -> dict:
        return {"finish": self.finish, "turns": self.turns, "transcript": self.transcript,
                "completion_tokens": self.completion_tokens}


async def run_agent(generate: Generate, search: Search, tokenizer, grammar: Grammar, prompt_ids: list[int], *,
                    prefix: str = "", max_tokens: int, max_model_len: int, stop: list[str], seed: int | None,
                    timeout_s: float) -> AgentResult:
    """Drive one episode. `prefix` is text already in the prompt that belongs to the model's first turn (a continued
    assistant message), so a query it opened is closed by the first generation. `max_tokens` bounds the model's
    tokens; the grammar's `max_response_tokens` bounds model and retriever tokens together."""
    ids, transcript, segment = list(prompt_ids), "", prefix
    written, turns = 0, []
    stops = sorted(set(stop) | set(grammar.stops()))
    while True:
        room = min(max_tokens - written, grammar.max_response_tokens - (len(ids) - len(prompt_ids)),
                   max_model_len - len(ids))
        if room <= 0:
            return AgentResult(None, "budget", transcript, written, turns)
        turn_sampling_seed = None if seed is None else turn_seed(seed, len(turns))
        text, new_ids, stopped_by = await generate(ids, room, stops, turn_sampling_seed)
        ids += new_ids
        transcript += text
        segment += text
        written += len(new_ids)
        if stopped_by == f"</{grammar.answer_tag}>":
            return AgentResult(_answer(prefix + transcript, grammar), "answer", transcript, written, turns)
        if stopped_by != grammar.action_close:
            return AgentResult(None, "stop" if stopped_by else "length", transcript, written, turns)
        if len(turns) >= grammar.max_turns:
            return AgentResult(None, "turn_limit", transcript, written, turns)
        query = grammar.action_text(segment)
        hits, error = await _search(search, query, grammar.top_k, timeout_s)
        turns.append({"query": query, "chunk_ids": [hit["id"] for hit in hits or []], "error": error})
        observation = grammar.wrap_observation(retrieval_text(hits, error))
        observation_ids = tokenizer.encode(observation, add_special_tokens=False)[:grammar.max_observation_tokens]
        ids += observation_ids
        transcript += tokenizer.decode(observation_ids, skip_special_tokens=False)
        segment = ""


async def _search(search: Search, query: str, top_k: int, timeout_s: float) -> tuple[list[dict] | None, str | None]:
    """The hits, or the error the model is shown instead (as in training: it can go on without them)."""
    if not query:
        return None, "empty query"
    try:
        hits = (await asyncio.wait_for(search([query], top_k), timeout_s))[0]
        return hits[:top_k], None
    except asyncio.TimeoutError:
        return None, "timeout"
    except Exception as e:  # noqa: BLE001  a failed retriever gives an observation, not a failed request
        return None, type(e).__name__


def _answer(text: str, grammar: Grammar) -> str | None:
    found = re.findall(rf"<{grammar.answer_tag}>(.*?)</{grammar.answer_tag}>", text, flags=re.S)
    return found[-1].strip() if found else None

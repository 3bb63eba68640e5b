"""Multi-turn episodes on a live vLLM engine: generate until the grammar's action tag closes, fetch the observation
(retrieved documents) asynchronously, append it with loss mask 0, and continue, up to a turn limit and a token budget.

A single-turn task is the same loop with no action tag. Requests go through the engine's add_request/step interface,
so while one batch of queries is with the retriever the engine keeps decoding every other episode.
"""
from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass, field

import ray
from pydantic import BaseModel, ConfigDict, Field

from actors.trajectory import Trajectory


class Grammar(BaseModel):
    """Which tags the policy and the environment write (configuration, not code paths): `rollout.grammar`.

    Med-RwR: query/retrieve; Med-R3: search/document; Search-R1: search/information; single turn: action_tag null.
    """
    model_config = ConfigDict(extra="forbid")

    answer_tag: str = "answer"
    action_tag: str | None = Field(None, description="the policy asks the environment with <tag>...</tag>")
    observation_tag: str = Field("retrieve", description="the environment answers inside <tag>...</tag>")
    max_turns: int = Field(4, ge=0, description="environment calls per episode")
    max_response_tokens: int = Field(512, ge=1, description="policy + environment tokens after the prompt")
    max_observation_tokens: int = Field(256, ge=1)
    top_k: int = Field(3, ge=1, description="documents per query (Med-RwR 3, Med-R3 5)")

    @property
    def action_close(self) -> str | None:
        return f"</{self.action_tag}>" if self.action_tag else None

    def stops(self) -> list[str]:
        return [f"</{self.answer_tag}>"] + ([self.action_close] if self.action_tag else [])

    def action_text(self, segment: str) -> str:
        """The content of the last <action_tag> block the policy just closed."""
        found = re.findall(rf"<{self.action_tag}>(.*?)</{self.action_tag}>", segment, flags=re.S)
        return found[-1].strip() if found else ""

    def format_observation(self, docs: list[dict] | None, error: str | None) -> str:
        if error is not None:
            body = f"retrieval failed ({error}); continue without it"
        else:
            body = "\n".join(f"[{i + 1}] {d.get('title', '')}: {d['text']}" for i, d in enumerate(docs)) or "no results"
        return f"\n<{self.observation_tag}>\n{body}\n</{self.observation_tag}>\n"


@dataclass
class Episode:
    task: dict
    group: int
    seed: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    finish_reason: str = ""

    def extend(self, ids: list[int], logprobs: list[float], by_policy: bool) -> None:
        self.response_ids += ids
        self.logprobs += logprobs if by_policy else [0.0] * len(ids)
        self.loss_mask += [int(by_policy)] * len(ids)


def derive_seed(*parts: int) -> int:
    """A 31-bit seed that is a fixed function of `parts` (run seed, step, prompt, sample, turn, ...), decorrelated
    across them: every random stream of a run is derived, so resuming needs no saved generator state."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of an episode's `turn`-th generation (turn 0 keeps the episode's own seed)."""
    return seed if turn == 0 else derive_seed(seed, turn)


class EpisodeRunner:
    """Drives episodes to completion on `engine` (a vLLM LLMEngine), calling `retriever.search.remote(queries,
    top_k)` for observations when the grammar has an action tag."""

    def __init__(self, engine, tokenizer, grammar: Grammar, retriever=None, retrieval_timeout_s: float = 60.0):
        if grammar.action_tag and retriever is None:
            raise ValueError(f"grammar action tag <{grammar.action_tag}> needs a retriever")
        self.engine, self.tokenizer, self.grammar = engine, tokenizer, grammar
        self.retriever, self.timeout_s = retriever, retrieval_timeout_s
        self._next_id = 0

    def run(self, episodes: list[Episode], sampling: dict) -> dict:
        """Run every episode to the end; returns statistics (engine idle time waiting on retrieval, errors)."""
        from vllm import SamplingParams

        g = self.grammar
        live: dict[str, Episode] = {}
        waiting: dict[ray.ObjectRef, tuple[list[Episode], float]] = {}
        stats = {"env_calls": 0, "env_errors": 0, "idle_s": 0.0}
        start = time.perf_counter()

        def submit(ep: Episode) -> None:
            budget = g.max_response_tokens - len(ep.response_ids)
            params = SamplingParams(**{**sampling, "max_tokens": min(sampling["max_tokens"], budget),
                                       "stop": sorted(set(sampling.get("stop") or []) | set(g.stops()))},
                                    seed=turn_seed(ep.seed, len(ep.turns)), logprobs=0,
                                    include_stop_str_in_output=True, skip_special_tokens=False)
            request_id = f"ep{self._next_id}"
            self._next_id += 1
            live[request_id] = ep
            self.engine.add_request(request_id, {"prompt_token_ids": ep.prompt_ids + ep.response_ids}, params)

        def on_generated(ep: Episode, out) -> Episode | None:
            """Record a finished generation; the episode if it now waits on the environment."""
            seq = out.outputs[0]
            ids = list(seq.token_ids)
            ep.extend(ids, [lp[t].logprob for lp, t in zip(seq.logprobs, ids)], by_policy=True)
            asked = g.action_tag is not None and seq.finish_reason == "stop" and seq.stop_reason == g.action_close
            if not asked:
                ep.finish_reason = seq.finish_reason or "length"
            elif len(ep.turns) >= g.max_turns:
                ep.finish_reason = "turn_limit"
            elif len(ep.response_ids) >= g.max_response_tokens:
                ep.finish_reason = "budget"
            else:
                ep.turns.append({"query": g.action_text(seq.text)})
                return ep
            return None

        def observe(eps: list[Episode], docs: list[list[dict]] | None, error: str | None) -> None:
            for i, ep in enumerate(eps):
                hits = docs[i][:g.top_k] if docs is not None else None
                ep.turns[-1].update(error=error, chunks=[{"id": d["id"], "doc_id": d.get("doc_id"), "text": d["text"]}
                                                         for d in hits or []])
                ids = self.tokenizer.encode(g.format_observation(hits, error), add_special_tokens=False)
                room = g.max_response_tokens - len(ep.response_ids)
                ep.extend(ids[:min(g.max_observation_tokens, room)], [], by_policy=False)
                if len(ep.response_ids) >= g.max_response_tokens:
                    ep.finish_reason = "budget"
                else:
                    submit(ep)

        for ep in episodes:
            submit(ep)
        while live or waiting:
            asking: list[Episode] = []
            if live:
                for out in self.engine.step():
                    if out.finished:
                        ep = on_generated(live.pop(out.request_id), out)
                        if ep is not None:
                            asking.append(ep)
            if asking:  # every query this step produced goes to the retriever as one batch
                stats["env_calls"] += len(asking)
                queries = [ep.turns[-1]["query"] for ep in asking]
                search = getattr(self.retriever, "search_async", None)  # a ShardedRetriever, else an actor handle
                ref = search(queries, g.top_k) if search else self.retriever.search.remote(queries, g.top_k)
                waiting[ref] = (asking, time.perf_counter())
            if waiting:
                idle = not live
                t0 = time.perf_counter()
                ready, _ = ray.wait(list(waiting), num_returns=1 if idle else len(waiting),
                                    timeout=self.timeout_s if idle else 0)
                if idle:
                    stats["idle_s"] += time.perf_counter() - t0
                for ref in ready:
                    eps, _ = waiting.pop(ref)
                    try:
                        observe(eps, ray.get(ref), None)
                    except Exception as e:  # noqa: BLE001  the episode gets an observation it can recover from
                        stats["env_errors"] += len(eps)
                        observe(eps, None, type(e).__name__)
                for ref, (eps, sent) in list(waiting.items()):
                    if time.perf_counter() - sent > self.timeout_s:
                        waiting.pop(ref)
                        stats["env_errors"] += len(eps)
                        observe(eps, None, "timeout")
        stats["seconds"] = time.perf_counter() - start
        return stats


def to_trajectory(ep: Episode, tokenizer, version: int) -> Trajectory:
    return Trajectory(task=ep.task, group=ep.group, prompt_ids=ep.prompt_ids, response_ids=ep.response_ids,
                      logprobs=ep.logprobs, loss_mask=ep.loss_mask,
                      text=tokenizer.decode(ep.response_ids, skip_special_tokens=False),
                      finish_reason=ep.finish_reason, weight_version=version, turns=ep.turns)

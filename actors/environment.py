"""Training's driver of multi-turn episodes on a live vLLM engine (:class:`EpisodeRunner`), and the
:class:`Environment` it asks: generate until the grammar's action tag closes, hand the action to the environment (a
retriever, a tool Gym) asynchronously, append its observation with loss mask 0, and continue, up to a turn limit and
a token budget. The turn logic is the episode's own (actors/episode.py), which serving's agent runs too.

A single-turn task is the same loop with no action tag. Requests go through the engine's add_request/step interface,
so while one batch of actions is with the environment the engine keeps decoding every other episode.
"""
from __future__ import annotations

import time

import ray

from actors.entropy import topk_entropy
from actors.episode import Episode, Generation, Observation
from actors.grammar import Grammar
from actors.image_tokens import ImageTokens


class Environment:
    """What :class:`EpisodeRunner` calls when a policy closes the grammar's action tag. Subclasses hold only actor
    handles and settings, so they travel to rollout workers.

    `call` starts the work for a batch of actions and returns, per episode, either an :class:`Observation` already
    decided (e.g. an invalid call) or `(ref, index)`: its raw result is item `index` of the list `ref` resolves to
    (index None: all of it), so one batched remote call can serve many episodes. `observe` turns a raw result, or
    the error that replaced it, into the observation.
    """
    timeout_s: float = 60.0
    role: str = "environment"  # its actors' role in the metrics (actor_restarts/<role>)

    def call(self, episodes: list[Episode], actions: list[str]) -> list:
        raise NotImplementedError

    def observe(self, episode: Episode, action: str, result, error: str | None) -> Observation:
        raise NotImplementedError

    def actors(self) -> list:
        """The actor handles serving this environment (the trainer releases them at the end of a run)."""
        return []


class EpisodeRunner:
    """Drives episodes to completion on `engine` (a vLLM LLMEngine), asking `environment` for an observation each
    time the policy closes the grammar's action tag. `vision`: how a multimodal policy's images become tokens
    (None: a text-only policy)."""

    def __init__(self, engine, tokenizer, grammar: Grammar, environment: Environment | None = None,
                 vision: ImageTokens | None = None):
        if grammar.action_tag and environment is None:
            raise ValueError(f"grammar action tag <{grammar.action_tag}> needs an environment (retriever or tools)")
        self.engine, self.tokenizer, self.grammar, self.environment = engine, tokenizer, grammar, environment
        self.vision = vision
        self.top_logprobs = 0  # > 0: record each policy token's entropy from this many log-probabilities
        self._next_id = 0

    def run(self, episodes: list[Episode], sampling: dict) -> dict:
        """Run every episode to the end; returns statistics (engine idle time waiting on the environment, errors).
        Each engine step's finished generations that closed an action go to the environment as one batch; their
        observations are collected while the engine decodes the other episodes."""
        from vllm import SamplingParams

        g, env = self.grammar, self.environment
        stop_ids = sorted(set(sampling.get("stop_token_ids") or []) | set(self.vision.special_ids)) \
            if self.vision else sampling.get("stop_token_ids")
        turn = {**sampling, "stop": sorted(set(sampling.get("stop") or []) | set(g.stops())),
                "stop_token_ids": stop_ids}
        live: dict[str, Episode] = {}
        waiting: dict[ray.ObjectRef, tuple[list[tuple[Episode, str, int | None]], float]] = {}
        stats = {"env_calls": 0, "env_errors": 0, "idle_s": 0.0}
        start = time.perf_counter()

        def submit(ep: Episode) -> None:
            params = SamplingParams(**{**turn, "max_tokens": min(sampling["max_tokens"], ep.room(g))},
                                    seed=ep.sampling_seed(), logprobs=self.top_logprobs,
                                    include_stop_str_in_output=True, skip_special_tokens=False)
            request_id = f"ep{self._next_id}"
            self._next_id += 1
            live[request_id] = ep
            self.engine.add_request(request_id, ep.engine_prompt(self.vision), params)

        def observe(ep: Episode, obs: Observation) -> None:
            stats["env_errors"] += obs.record.get("error") is not None
            if ep.observed(g, obs, self.tokenizer, self.vision):
                submit(ep)

        for ep in episodes:
            submit(ep)
        while live or waiting:
            asking: list[tuple[Episode, str]] = []
            for out in self.engine.step() if live else []:
                if out.finished:
                    ep = live.pop(out.request_id)
                    if (action := ep.generated(g, self.generation(out), vision=self.vision)) is not None:
                        asking.append((ep, action))
            if asking:
                stats["env_calls"] += len(asking)
                sent = time.perf_counter()
                for (ep, action), pending in zip(asking, env.call([ep for ep, _ in asking], [a for _, a in asking])):
                    if isinstance(pending, Observation):
                        observe(ep, pending)
                    else:
                        ref, index = pending
                        waiting.setdefault(ref, ([], sent))[0].append((ep, action, index))
            if waiting:
                idle = not live
                t0 = time.perf_counter()
                ready, _ = ray.wait(list(waiting), num_returns=1 if idle else len(waiting),
                                    timeout=env.timeout_s if idle else 0)
                if idle:
                    stats["idle_s"] += time.perf_counter() - t0
                for ref in ready:
                    try:
                        results, error = ray.get(ref), None
                    except Exception as e:  # noqa: BLE001  the episodes get an observation they can recover from
                        results, error = None, type(e).__name__
                    for ep, action, index in waiting.pop(ref)[0]:
                        result = results if results is None or index is None else results[index]
                        observe(ep, env.observe(ep, action, result, error))
                for ref, (asked, sent) in list(waiting.items()):
                    if time.perf_counter() - sent > env.timeout_s:
                        waiting.pop(ref)
                        for ep, action, _ in asked:
                            observe(ep, env.observe(ep, action, None, "timeout"))
        stats["seconds"] = time.perf_counter() - start
        return stats

    def generation(self, out) -> Generation:
        """A finished request's generation, with each token's entropy from its top log-probabilities if recorded."""
        seq = out.outputs[0]
        entropies = [topk_entropy([x.logprob for x in lp.values() if x.rank <= self.top_logprobs], len(self.tokenizer))
                     for lp in seq.logprobs] if self.top_logprobs else None
        return Generation.from_vllm(seq, entropies)

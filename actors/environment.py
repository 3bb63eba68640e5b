"""Training's driver of multi-turn episodes on a live vLLM engine (:class:`EpisodeRunner`), and the
:class:`Environment` it asks: generate until the grammar's action tag closes, hand the action to the environment (a
retriever, a tool Gym) asynchronously, append its observation with loss mask 0, and continue, up to a turn limit and
a token budget. The loop and its turn logic are the episode's own (`actors.episode.play`), which serving's agent runs
too: the runner answers each episode's requests.

A single-turn task is the same loop with no action tag. Requests go through the engine's add_request/step interface,
so while one batch of actions is with the environment the engine keeps decoding every other episode.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import ray

from actors.entropy import topk_entropy
from actors.episode import Act, Episode, EpisodeLoop, Generate, Generation, Observation, next_request, play
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


@dataclass
class Running:
    """An episode in the runner's pool: its loop (`actors.episode.play`) and the sampling its generations use."""
    episode: Episode
    loop: EpisodeLoop
    sampling: dict


class EpisodeRunner:
    """Drives episodes to completion on `engine` (a vLLM LLMEngine), asking `environment` for an observation each
    time the policy closes the grammar's action tag. `vision`: how a multimodal policy's images become tokens
    (None: a text-only policy).

    The runner is a pool: `run` drives a batch of episodes to their end; `admit` adds episodes and `advance` runs the
    pool for a while and hands back those that ended, so episodes can go on across calls (fully asynchronous
    rollouts) while the engine's weights change between them: each token keeps the weight version that sampled it
    (`Episode.versions`, from vLLM's weight-version spans)."""

    def __init__(self, engine, tokenizer, grammar: Grammar, environment: Environment | None = None,
                 vision: ImageTokens | None = None):
        if grammar.action_tag and environment is None:
            raise ValueError(f"grammar action tag <{grammar.action_tag}> needs an environment (retriever or tools)")
        self.engine, self.tokenizer, self.grammar, self.environment = engine, tokenizer, grammar, environment
        self.vision = vision
        self.top_logprobs = 0  # > 0: record each policy token's entropy from this many log-probabilities
        self.cache_salt: str | None = None  # prefixes cached under other weights must not be reused: set per version
        self._next_id = 0
        self.live: dict[str, Running] = {}  # request id -> the episode generating
        # environment calls in flight: ref -> ([(the running episode, its action, its index in the result)], when sent)
        self.waiting: dict[ray.ObjectRef, tuple[list[tuple[Running, str, int | None]], float]] = {}
        self.ended: list[Episode] = []   # ended and not yet handed back by `advance`
        self.stats = {"env_calls": 0, "env_errors": 0, "idle_s": 0.0}

    def run(self, episodes: list[Episode], sampling: dict) -> dict:
        """Run `episodes` to their end (episodes admitted before go on meanwhile and stay in the pool); returns
        statistics since the last call: environment calls and errors, engine idle time waiting on the environment.
        Each engine step's finished generations that closed an action go to the environment as one batch; their
        observations are collected while the engine decodes the other episodes."""
        start = time.perf_counter()
        self.admit(episodes, sampling)
        mine = {id(ep) for ep in episodes}
        pending = {id(ep) for ep in episodes if not ep.finish_reason}
        while pending:
            pending -= {id(ep) for ep in self.tick()}
        self.ended = [ep for ep in self.ended if id(ep) not in mine]
        return {**self.take_stats(), "seconds": time.perf_counter() - start}

    def admit(self, episodes: list[Episode], sampling: dict) -> None:
        """Start each episode's loop; its generations take at most `sampling["max_tokens"]` tokens each."""
        for ep in episodes:
            loop = play(ep, self.grammar, self.tokenizer, self.vision, lambda _: sampling["max_tokens"])
            self._answer(Running(ep, loop, sampling), None, self.ended)

    def advance(self, seconds: float) -> list[Episode]:
        """Run the pool for about `seconds` (at least one engine step) or until it is empty; returns the episodes
        that ended since the last call."""
        deadline = time.perf_counter() + seconds
        while self.live or self.waiting:
            self.tick()
            if time.perf_counter() >= deadline:
                break
        ended, self.ended = self.ended, []
        return ended

    def busy(self) -> int:
        """Episodes in the pool that have not ended."""
        return len(self.live) + sum(len(asked) for asked, _ in self.waiting.values())

    def abandon(self) -> None:
        """Drop every episode in the pool (their requests aborted, environment answers ignored)."""
        if self.live:
            self.engine.abort_request(list(self.live))
        self.live, self.waiting, self.ended = {}, {}, []

    def take_stats(self) -> dict:
        stats, self.stats = self.stats, {"env_calls": 0, "env_errors": 0, "idle_s": 0.0}
        return stats

    def tick(self) -> list[Episode]:
        """One engine step, its closed actions sent to the environment, and the observations that arrived; returns
        the episodes that ended in it (also kept for `advance`)."""
        ended, asking = [], []
        for out in self.engine.step() if self.live else []:
            if out.finished:
                running = self.live.pop(out.request_id)
                if (request := self._answer(running, self.generation(out), ended)) is not None:
                    asking.append((running, request.action))
        if asking:
            self.stats["env_calls"] += len(asking)
            sent = time.perf_counter()
            calls = self.environment.call([r.episode for r, _ in asking], [action for _, action in asking])
            for (running, action), pending in zip(asking, calls):
                if isinstance(pending, Observation):
                    self._observe(running, pending, ended)
                else:
                    ref, index = pending
                    self.waiting.setdefault(ref, ([], sent))[0].append((running, action, index))
        if self.waiting:
            self._collect_observations(ended)
        self.ended += ended
        return ended

    def _collect_observations(self, ended: list[Episode]) -> None:
        """The environment's answers that arrived (waiting for one when no episode is decoding), and a timeout's
        observation for calls older than the environment's `timeout_s`."""
        env, idle = self.environment, not self.live
        t0 = time.perf_counter()
        ready, _ = ray.wait(list(self.waiting), num_returns=1 if idle else len(self.waiting),
                            timeout=env.timeout_s if idle else 0)
        if idle:
            self.stats["idle_s"] += time.perf_counter() - t0
        for ref in ready:
            try:
                results, error = ray.get(ref), None
            except Exception as e:  # noqa: BLE001  the episodes get an observation they can recover from
                results, error = None, type(e).__name__
            for running, action, index in self.waiting.pop(ref)[0]:
                result = results if results is None or index is None else results[index]
                self._observe(running, env.observe(running.episode, action, result, error), ended)
        for ref, (asked, sent) in list(self.waiting.items()):
            if time.perf_counter() - sent > env.timeout_s:
                self.waiting.pop(ref)
                for running, action, _ in asked:
                    self._observe(running, env.observe(running.episode, action, None, "timeout"), ended)

    def _observe(self, running: Running, obs: Observation, ended: list[Episode]) -> None:
        self.stats["env_errors"] += obs.record.get("error") is not None
        self._answer(running, obs, ended)

    def _answer(self, running: Running, answer: Generation | Observation | None, ended: list[Episode]) -> Act | None:
        """Give the episode's loop `answer`; its next request: a generation goes to the engine, an action is
        returned (the caller batches them for the environment), an ended episode joins `ended`."""
        request = next_request(running.loop, answer)
        if request is None:
            ended.append(running.episode)
        elif isinstance(request, Generate):
            self._submit(running, request)
        else:
            return request
        return None

    def _submit(self, running: Running, request: Generate) -> None:
        """A generation the loop asked for, with the grammar's stops, as one engine request."""
        from vllm import SamplingParams

        sampling = running.sampling
        stop_ids = set(sampling.get("stop_token_ids") or []) | set(self.vision.special_ids if self.vision else [])
        stops = set(sampling.get("stop") or []) | set(self.grammar.stops())
        params = SamplingParams(**{**sampling, "stop": sorted(stops), "stop_token_ids": sorted(stop_ids) or None,
                                   "max_tokens": request.max_tokens},
                                seed=request.seed, logprobs=self.top_logprobs,
                                include_stop_str_in_output=True, skip_special_tokens=False)
        request_id = f"ep{self._next_id}"
        self._next_id += 1
        self.live[request_id] = running
        prompt = request.prompt
        if self.cache_salt:
            prompt["cache_salt"] = self.cache_salt
        self.engine.add_request(request_id, prompt, params)

    def generation(self, out) -> Generation:
        """A finished request's generation, with each token's entropy from its top log-probabilities if recorded."""
        seq = out.outputs[0]
        entropies = [topk_entropy([x.logprob for x in lp.values() if x.rank <= self.top_logprobs], len(self.tokenizer))
                     for lp in seq.logprobs] if self.top_logprobs else None
        return Generation.from_vllm(seq, entropies)

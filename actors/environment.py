"""Multi-turn episodes on a live vLLM engine: generate until the grammar's action tag closes, hand the action to the
environment (a retriever, a tool Gym) asynchronously, append its observation with loss mask 0, and continue, up to a
turn limit and a token budget.

A single-turn task is the same loop with no action tag. Requests go through the engine's add_request/step interface,
so while one batch of actions is with the environment the engine keeps decoding every other episode.

Images (a multimodal policy, :class:`actors.image_tokens.ImageTokens`): the episode's token ids hold each image as its
full run of pad tokens (`<|image_pad|>` for Qwen2-VL; what the learner's forward needs); vLLM gets each run collapsed
to one pad plus the images as `multi_modal_data`, and expands it itself.
"""
from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass, field

import numpy as np
import ray
from pydantic import BaseModel, ConfigDict, Field, model_validator

from actors.entropy import topk_entropy
from actors.image_tokens import ImageTokens
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

    @model_validator(mode="before")
    @classmethod
    def _top_k_moved(cls, data):
        if isinstance(data, dict) and "top_k" in data:
            raise ValueError("top_k is not a grammar key: documents per query are the retriever's one setting, "
                             "retrieval.search.top_k (agent.retrieval.top_k when serving); move it there")
        return data

    @property
    def action_close(self) -> str | None:
        return f"</{self.action_tag}>" if self.action_tag else None

    def stops(self) -> list[str]:
        return [f"</{self.answer_tag}>"] + ([self.action_close] if self.action_tag else [])

    def action_text(self, segment: str) -> str:
        """The content of the last <action_tag> block the policy just closed."""
        found = re.findall(rf"<{self.action_tag}>(.*?)</{self.action_tag}>", segment, flags=re.S)
        return found[-1].strip() if found else ""

    def wrap_observation(self, body: str) -> str:
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
    images: list[np.ndarray] = field(default_factory=list)   # RGB uint8 arrays of every image in the ids, in order
    image_grids: list[tuple[int, int, int]] = field(default_factory=list)  # their (t, h, w) patch grids
    entropies: list[float] = field(default_factory=list)     # per response token (0 on the environment's), if recorded
    branch: dict | None = None                                # a fork: {"of": base rollout, "at": token}

    def extend(self, ids: list[int], logprobs: list[float], by_policy: bool,
               entropies: list[float] | None = None) -> None:
        self.response_ids += ids
        self.logprobs += logprobs if by_policy else [0.0] * len(ids)
        self.loss_mask += [int(by_policy)] * len(ids)
        self.entropies += entropies if entropies is not None else [0.0] * len(ids)

    def fork(self, position: int, seed: int, images: int) -> Episode:
        """A copy of this episode's first `position` response tokens, with the turns and the first `images` images
        that lie before them, that samples on from there with `seed`: a branch."""
        mask = self.loss_mask[:position]
        turns = sum(1 for i in range(1, len(mask)) if mask[i - 1] == 0 and mask[i] == 1)  # observations passed
        return Episode(task=self.task, group=self.group, seed=seed, prompt_ids=self.prompt_ids,
                       response_ids=self.response_ids[:position], logprobs=self.logprobs[:position], loss_mask=mask,
                       turns=[dict(t) for t in self.turns[:turns]], images=self.images[:images],
                       image_grids=self.image_grids[:images], entropies=self.entropies[:position])


def derive_seed(*parts: int) -> int:
    """A 31-bit seed that is a fixed function of `parts` (run seed, step, prompt, sample, turn, ...), decorrelated
    across them: every random stream of a run is derived, so resuming needs no saved generator state."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of an episode's `turn`-th generation (turn 0 keeps the episode's own seed)."""
    return seed if turn == 0 else derive_seed(seed, turn)


@dataclass
class Observation:
    """What the environment answers to one action: text shown inside the grammar's observation tags, the record kept
    in the trajectory's turn (rewards read it), images shown to a multimodal policy, and whether the episode ends."""
    text: str
    record: dict = field(default_factory=dict)
    images: list = field(default_factory=list)
    done: bool = False


def rgb_array(image) -> np.ndarray:
    """An image (PIL, or an array HxW / HxWx3 / HxWx4) as the RGB uint8 HxWx3 array vLLM and the learner both get."""
    if not isinstance(image, np.ndarray):
        return np.array(image.convert("RGB"))  # writable: torch.from_numpy warns on read-only arrays
    if image.dtype != np.uint8:
        raise ValueError(f"image arrays must be uint8, got {image.dtype}")
    if image.ndim == 2:
        return np.repeat(image[:, :, None], 3, axis=2)
    if image.ndim == 3 and image.shape[2] in (3, 4):
        return np.ascontiguousarray(image[:, :, :3])
    raise ValueError(f"an image array must be HxW, HxWx3 or HxWx4, got shape {image.shape}")


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
        """Run every episode to the end; returns statistics (engine idle time waiting on the environment, errors)."""
        from vllm import SamplingParams

        g, env = self.grammar, self.environment
        vocab = len(self.tokenizer)
        live: dict[str, Episode] = {}
        waiting: dict[ray.ObjectRef, tuple[list[tuple[Episode, str, int | None]], float]] = {}
        stats = {"env_calls": 0, "env_errors": 0, "idle_s": 0.0}
        start = time.perf_counter()

        def submit(ep: Episode) -> None:
            budget = g.max_response_tokens - len(ep.response_ids)
            stop_ids = sorted(set(sampling.get("stop_token_ids") or []) | set(self.vision.special_ids)) \
                if self.vision else sampling.get("stop_token_ids")
            params = SamplingParams(**{**sampling, "max_tokens": min(sampling["max_tokens"], budget),
                                       "stop": sorted(set(sampling.get("stop") or []) | set(g.stops())),
                                       "stop_token_ids": stop_ids},
                                    seed=turn_seed(ep.seed, len(ep.turns)), logprobs=self.top_logprobs,
                                    include_stop_str_in_output=True, skip_special_tokens=False)
            request_id = f"ep{self._next_id}"
            self._next_id += 1
            live[request_id] = ep
            ids = ep.prompt_ids + ep.response_ids
            prompt = {"prompt_token_ids": self.vision.collapse(ids), "multi_modal_data": {"image": ep.images}} \
                if ep.images else {"prompt_token_ids": ids}
            self.engine.add_request(request_id, prompt, params)

        def on_generated(ep: Episode, out) -> str | None:
            """Record a finished generation; the action if the episode now waits on the environment."""
            seq = out.outputs[0]
            ids = list(seq.token_ids)
            logprobs = [lp[t].logprob for lp, t in zip(seq.logprobs, ids)]
            entropies = [topk_entropy([x.logprob for x in lp.values() if x.rank <= self.top_logprobs], vocab)
                         for lp in seq.logprobs] if self.top_logprobs else None
            if self.vision and ids and ids[-1] in self.vision.special_ids:  # dropped: it would be a fake image
                ep.extend(ids[:-1], logprobs[:-1], by_policy=True, entropies=entropies and entropies[:-1])
                ep.finish_reason = "vision_token"
                return None
            ep.extend(ids, logprobs, by_policy=True, entropies=entropies)
            asked = g.action_tag is not None and seq.finish_reason == "stop" and seq.stop_reason == g.action_close
            if not asked:
                ep.finish_reason = seq.finish_reason or "length"
            elif (ended := action_end(g, ep.turns, len(ep.response_ids))) is not None:
                ep.finish_reason = ended
            else:
                return g.action_text(seq.text)
            return None

        def observe(ep: Episode, obs: Observation) -> None:
            ep.turns.append(obs.record)
            if obs.record.get("error") is not None:
                stats["env_errors"] += 1
            ep.extend(self.observation_ids(ep, obs, observation_limit(g, len(ep.response_ids))), [], by_policy=False)
            if (ended := observation_end(g, obs, len(ep.response_ids))) is not None:
                ep.finish_reason = ended
            else:
                submit(ep)

        for ep in episodes:
            submit(ep)
        while live or waiting:
            asking: list[tuple[Episode, str]] = []
            if live:
                for out in self.engine.step():
                    if out.finished:
                        ep = live.pop(out.request_id)
                        action = on_generated(ep, out)
                        if action is not None:
                            asking.append((ep, action))
            if asking:  # every action this engine step produced goes to the environment as one batch
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

    def observation_ids(self, ep: Episode, obs: Observation, limit: int) -> list[int]:
        """The observation's tokens (:func:`observation_tokens`); the images that fit join the episode's images (the
        next turns see them)."""
        if obs.images and self.vision is None:
            raise ValueError(f"the environment returned {len(obs.images)} images for task {ep.task.get('id')!r}, "
                             "but the policy model is text-only (no image processor)")
        ids, images, grids = observation_tokens(self.tokenizer, self.grammar, self.vision, obs.text, obs.images, limit)
        ep.images += images
        ep.image_grids += grids
        return ids


def action_end(grammar: Grammar, turns: list[dict], response_tokens: int) -> str | None:
    """The turn logic training and serving share, when the policy has just closed the action tag after writing
    `response_tokens` tokens (policy and environment) with `turns` behind it: why the episode ends instead of asking
    the environment ("turn_limit", "budget"), or None: the action goes to the environment."""
    if len(turns) >= grammar.max_turns:
        return "turn_limit"
    if response_tokens >= grammar.max_response_tokens:
        return "budget"
    return None


def observation_limit(grammar: Grammar, response_tokens: int) -> int:
    """The most tokens the next observation may take: the grammar's observation cap, within the response budget."""
    return min(grammar.max_observation_tokens, grammar.max_response_tokens - response_tokens)


def observation_end(grammar: Grammar, observation: Observation, response_tokens: int) -> str | None:
    """Why the episode ends once `observation` is inserted (`response_tokens` now written): the environment ended it
    (its record's "finish", else "environment"), or the budget is spent ("budget"); None: the policy goes on."""
    if observation.done:
        return observation.record.get("finish", "environment")
    if response_tokens >= grammar.max_response_tokens:
        return "budget"
    return None


def observation_tokens(tokenizer, grammar: Grammar, vision: ImageTokens | None, text: str, images: list,
                       limit: int) -> tuple[list[int], list[np.ndarray], list[tuple[int, int, int]]]:
    """An observation as the policy reads it, at most `limit` tokens: its images first inside the grammar's observation
    tags (each a full run of pads; `vision` is needed when there are images), then its text. Returns the ids and the
    images that fit (RGB arrays) with their patch grids: an image that does not fit is dropped whole."""
    if not images:
        return tokenizer.encode(grammar.wrap_observation(text), add_special_tokens=False)[:limit], [], []
    arrays = [rgb_array(im) for im in images]
    grids = [vision.grid(im) for im in arrays]
    ids = vision.expand(tokenizer.encode(grammar.wrap_observation(vision.placeholder * len(arrays) + text),
                                         add_special_tokens=False), grids)
    ids = ids[:vision.cut(ids, limit)]
    kept = ids.count(vision.start_id)
    return ids, arrays[:kept], grids[:kept]


def to_trajectory(ep: Episode, tokenizer, version: int) -> Trajectory:
    return Trajectory(task=ep.task, group=ep.group, prompt_ids=ep.prompt_ids, response_ids=ep.response_ids,
                      logprobs=ep.logprobs, loss_mask=ep.loss_mask,
                      text=tokenizer.decode(ep.response_ids, skip_special_tokens=False),
                      finish_reason=ep.finish_reason, weight_version=version, turns=ep.turns,
                      images=ep.images, image_grids=ep.image_grids, branch=ep.branch)

"""One episode, its turn logic and its loop (:func:`play`), the one both drivers run: training's `EpisodeRunner` (a
batch of episodes on a vLLM `LLMEngine`, actors/environment.py) and serving's agent (one request's episode on the
async engine, serve/agent.py).

A turn: the loop asks for a generation (:class:`Generate`: the episode's prompt so far, at most the tokens left, the
turn's seed); :meth:`Episode.generated` records it and returns the action the policy closed (or None: the episode has
ended, `finish_reason` says why); the loop asks the environment (:class:`Act`); :meth:`Episode.observed` inserts its
observation and says whether the policy goes on. The drivers only answer the loop's requests, each with its own
engine and environment calls.

Images (a multimodal policy, :class:`actors.image_tokens.ImageTokens`): the episode's token ids hold each image as its
full run of pad tokens (`<|image_pad|>` for Qwen2-VL; what the learner's forward needs); vLLM gets each run collapsed
to one pad plus the images as `multi_modal_data`, and expands it itself.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Generator

import numpy as np

from actors.grammar import Grammar
from actors.image_tokens import ImageTokens
from actors.trajectory import Trajectory


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


@dataclass
class Generation:
    """One generation turn as the engine returned it: its text, token ids and their log-probabilities, vLLM's
    `finish_reason` ("stop" | "length") and `stop_reason` (the stop string that ended it, else None or a token id),
    and each token's entropy when recorded."""
    text: str
    ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    stop_reason: str | int | None = None
    entropies: list[float] | None = None
    versions: list[int] | None = None

    @classmethod
    def from_vllm(cls, seq, entropies: list[float] | None = None) -> Generation:
        """From vLLM's `CompletionOutput` (sampled with `logprobs` set)."""
        ids = list(seq.token_ids)
        return cls(seq.text, ids, [lp[t].logprob for lp, t in zip(seq.logprobs, ids)], seq.finish_reason,
                   seq.stop_reason, entropies, token_versions(seq.weight_versions, len(ids)))

    def cut_at_image_token(self, vision: ImageTokens | None) -> bool:
        """A multimodal policy's generation that ended on a token only images may bring loses that token (a stray pad
        would make the learner's forward look for image features that do not exist); True if it did. The text is
        not touched: the caller decides what it shows."""
        if not (vision and self.ids and self.ids[-1] in vision.special_ids):
            return False
        self.ids, self.logprobs = self.ids[:-1], self.logprobs[:-1]
        self.entropies = self.entropies and self.entropies[:-1]
        self.versions = self.versions and self.versions[:-1]
        return True


@dataclass
class Episode:
    task: dict
    group: int
    seed: int | None                                          # None: unseeded sampling (a served request)
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    finish_reason: str = ""
    images: list[np.ndarray] = field(default_factory=list)   # RGB uint8 arrays of every image in the ids, in order
    image_grids: list[tuple[int, int, int]] = field(default_factory=list)  # their (t, h, w) patch grids
    entropies: list[float] = field(default_factory=list)     # per response token (0 on the environment's), if recorded
    versions: list[int] = field(default_factory=list)        # per response token: the weight version that sampled it
                                                              # (-1 on the environment's and where unknown)
    branch: dict | None = None                                # a fork: {"of": base rollout, "at": token}

    # ---- the turn logic -------------------------------------------------------------------------------------
    def room(self, grammar: Grammar) -> int:
        """The tokens the policy may still write within the grammar's response budget (policy and environment)."""
        return grammar.max_response_tokens - len(self.response_ids)

    def sampling_seed(self) -> int | None:
        """The seed of the next generation: one per turn, derived from the episode's."""
        return None if self.seed is None else turn_seed(self.seed, len(self.turns))

    def engine_prompt(self, vision: ImageTokens | None) -> dict:
        """vLLM's token prompt of the episode so far (:func:`engine_prompt`)."""
        return engine_prompt(self.prompt_ids + self.response_ids, self.images, vision)

    def generated(self, grammar: Grammar, generation: Generation, segment: str | None = None,
                  vision: ImageTokens | None = None) -> str | None:
        """Record a generation; returns the action the policy just closed, to go to the environment, or None: the
        episode has ended, `finish_reason` says why: vLLM's ("stop" at the answer tag or end of sequence,
        "length"), "turn_limit" or "budget" (an action past the grammar's limits), "vision_token" (a token only images
        may bring, dropped: it would be a fake image). `segment`: the text the action is read from (default the
        generation's; :func:`play` puts a continued assistant message's text before the first)."""
        cut = generation.cut_at_image_token(vision)
        self.extend(generation.ids, generation.logprobs, by_policy=True, entropies=generation.entropies,
                    versions=generation.versions)
        if cut:
            self.finish_reason = "vision_token"
            return None
        asked = grammar.action_tag is not None and generation.finish_reason == "stop" \
            and generation.stop_reason == grammar.action_close
        if not asked:
            self.finish_reason = generation.finish_reason or "length"
        elif len(self.turns) >= grammar.max_turns:
            self.finish_reason = "turn_limit"
        elif len(self.response_ids) >= grammar.max_response_tokens:
            self.finish_reason = "budget"
        else:
            return grammar.action_text(generation.text if segment is None else segment)
        return None

    def observed(self, grammar: Grammar, observation: Observation, tokenizer, vision: ImageTokens | None) -> bool:
        """Insert the environment's answer: its record joins the turns, its tokens (:func:`observation_tokens`, at
        most what the grammar's observation cap and the response budget leave) the response with loss mask 0, the
        images that fit the episode's images. Returns whether the policy goes on; else `finish_reason` says why: the
        environment ended it (its record's "finish", else "environment"), or the budget is spent ("budget")."""
        self.turns.append(observation.record)
        if observation.images and vision is None:
            raise ValueError(f"the environment returned {len(observation.images)} images for task "
                             f"{self.task.get('id')!r}, but the policy model is text-only (no image processor)")
        limit = min(grammar.max_observation_tokens, self.room(grammar))
        ids, images, grids = observation_tokens(tokenizer, grammar, vision, observation.text, observation.images,
                                                limit)
        self.extend(ids, [], by_policy=False)
        self.images += images
        self.image_grids += grids
        if observation.done:
            self.finish_reason = observation.record.get("finish", "environment")
        elif self.room(grammar) <= 0:
            self.finish_reason = "budget"
        return not self.finish_reason

    # ---- the record -----------------------------------------------------------------------------------------
    def extend(self, ids: list[int], logprobs: list[float], by_policy: bool,
               entropies: list[float] | None = None, versions: list[int] | None = None) -> None:
        self.response_ids += ids
        self.logprobs += logprobs if by_policy else [0.0] * len(ids)
        self.loss_mask += [int(by_policy)] * len(ids)
        self.entropies += entropies if entropies is not None else [0.0] * len(ids)
        self.versions += versions if versions is not None else [-1] * len(ids)

    def fork(self, position: int, seed: int | None, images: int) -> Episode:
        """A copy of this episode's first `position` response tokens, with the turns and the first `images` images
        that lie before them, that samples on from there with `seed`: a branch."""
        mask = self.loss_mask[:position]
        turns = sum(1 for i in range(1, len(mask)) if mask[i - 1] == 0 and mask[i] == 1)  # observations passed
        return Episode(task=self.task, group=self.group, seed=seed, prompt_ids=self.prompt_ids,
                       response_ids=self.response_ids[:position], logprobs=self.logprobs[:position], loss_mask=mask,
                       turns=[dict(t) for t in self.turns[:turns]], images=self.images[:images],
                       image_grids=self.image_grids[:images], entropies=self.entropies[:position],
                       versions=self.versions[:position])

    def to_trajectory(self, tokenizer, version: int) -> Trajectory:
        """`version`: the weight version to record where no token's is known (no policy token, unlabelled
        weights); else the oldest of the policy's tokens."""
        known = [v for v, by_policy in zip(self.versions, self.loss_mask) if by_policy and v >= 0]
        return Trajectory(task=self.task, group=self.group, prompt_ids=self.prompt_ids,
                          response_ids=self.response_ids, logprobs=self.logprobs, loss_mask=self.loss_mask,
                          text=tokenizer.decode(self.response_ids, skip_special_tokens=False),
                          finish_reason=self.finish_reason, weight_version=min(known, default=version),
                          versions=self.versions, turns=self.turns,
                          images=self.images, image_grids=self.image_grids, branch=self.branch)


@dataclass
class Generate:
    """The loop asks the engine for the next turn: vLLM's token prompt of the episode so far, at most `max_tokens` new
    tokens, sampled with `seed` (None: unseeded)."""
    prompt: dict
    max_tokens: int
    seed: int | None


@dataclass
class Act:
    """The loop asks the environment to answer the action the policy closed."""
    action: str


EpisodeLoop = Generator["Generate | Act", "Generation | Observation", None]


def play(episode: Episode, grammar: Grammar, tokenizer, vision: ImageTokens | None = None,
         limit: Callable[[Episode], int] | None = None, prefix: str = "") -> EpisodeLoop:
    """The episode loop: yields a :class:`Generate` (answer it with the engine's :class:`Generation`) or an
    :class:`Act` (answer it with the environment's :class:`Observation`) until the episode ends; `finish_reason` then
    says why. `limit(episode)`: the driver's own bound on the next generation (a per-turn `max_tokens`, a served
    request's token and context budget), beside the grammar's response budget; no room left ends it with "budget".
    `prefix`: text already in the prompt that belongs to the first turn's action (a continued assistant message)."""
    segment = prefix
    while True:
        room = episode.room(grammar) if limit is None else min(episode.room(grammar), limit(episode))
        if room <= 0:
            episode.finish_reason = "budget"
            return
        generation = yield Generate(episode.engine_prompt(vision), room, episode.sampling_seed())
        action = episode.generated(grammar, generation, segment + generation.text, vision)
        if action is None or not episode.observed(grammar, (yield Act(action)), tokenizer, vision):
            return
        segment = ""


def next_request(loop: EpisodeLoop, answer: Generation | Observation | None = None) -> Generate | Act | None:
    """The loop's next request once it has `answer` (None: its first), or None once the episode has ended."""
    try:
        return loop.send(answer)
    except StopIteration:
        return None


def token_versions(spans, n: int) -> list[int] | None:
    """Each of `n` tokens' weight version from vLLM's `WeightVersionSpan`s ([start, end) labelled `version`); None
    when there are none or a label is not a learner version (an engine whose weights were never labelled)."""
    if not spans or not all(span.version.isdigit() for span in spans):
        return None
    versions = [-1] * n
    for span in spans:
        versions[span.start:span.end] = [int(span.version)] * (span.end - span.start)
    return versions


def engine_prompt(ids: list[int], images: list, vision: ImageTokens | None) -> dict:
    """vLLM's token prompt of `ids` that hold each of `images` as its full run of pads: each run collapsed to one pad
    (vLLM expands it itself), the images beside."""
    if not images:
        return {"prompt_token_ids": ids}
    return {"prompt_token_ids": vision.collapse(ids), "multi_modal_data": {"image": images}}


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

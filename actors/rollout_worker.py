"""RolloutWorker: a Ray actor holding a vLLM engine that samples trajectories and takes new weights live."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import ray

from actors.environment import Environment, EpisodeRunner
from actors.episode import Episode, Generation, derive_seed, engine_prompt, rgb_array
from actors.grammar import Grammar
from actors.hooks import RolloutBatch, RolloutHook
from actors.image_tokens import ImageTokens
from actors.trajectory import GroupSummary, RolloutSummary, SliceSummary, Trajectory
from actors.engine_weights import (begin_reload, finish_reload, join_broadcast, load_broadcast, load_weights,
                                   quiet_reload_notices)
from cluster.devices import accelerator, step_peak_memory
from cluster.engine import EngineSettings, engine_args, prepare_engine_process
from cluster.weight_sync import WeightManifest, receive_buckets
from cluster.storage import local_checkpoint
from tasks.schema import chat_prompt_ids


def task_prompt(task: dict, tokenizer, vision: ImageTokens | None) -> tuple[list[int], list, list]:
    """A task's prompt ids with each image's full run of pads, its images (RGB arrays) and their patch grids."""
    from PIL import Image

    paths = task.get("images") or []
    if paths and vision is None:
        raise ValueError(f"task {task.get('id')!r} has {len(paths)} images but the policy model is text-only")
    images = []
    for path in paths:
        with Image.open(path) as image:
            images.append(rgb_array(image))
    grids = [vision.grid(im) for im in images]
    ids = chat_prompt_ids(tokenizer, task["messages"], len(images))
    return (vision.expand(ids, grids) if images else ids), images, grids


def shape(trajectories: list[Trajectory]) -> dict:
    """The fields a RolloutSummary or GroupSummary takes from its trajectories: response lengths, policy tokens,
    finish reasons."""
    return {"lengths": [len(t.response_ids) for t in trajectories],
            "policy_tokens": sum(t.num_policy_tokens for t in trajectories),
            "finish_reasons": [t.finish_reason for t in trajectories]}


@dataclass
class RolloutCall:
    """One worker's share of a step's rollouts, whole groups of tasks: the arguments of `RolloutWorker.rollout`."""
    tasks: list[dict]
    groups: list[int]            # each task's group index in the step
    group_size: int              # samples a group
    sampling: dict               # vLLM SamplingParams fields
    seed: int                    # the step's seed: each sample's is derived from it, its group and its index
    grammar: dict | None = None  # None: the worker's grammar
    hooks: list[RolloutHook] = field(default_factory=list)


@ray.remote(max_restarts=3, max_task_retries=0)
class RolloutWorker:
    """vLLM in-process inside the actor; multi-turn episodes run through `actors.environment.EpisodeRunner`.

    The engine core runs in this process (no engine-core subprocess: ~3 s start instead of ~25 s). With one shard the
    model does too (uni-process executor), so `update_weights` hands tensors straight to the model runner; with
    `tensor_parallel_size` > 1 each shard is a vLLM worker process with `threads` threads, and every weight update
    reaches each of them (actors/engine_weights.py).
    """

    def __init__(self, model_path: str, *, seed: int, threads: int, tensor_parallel_size: int = 1,
                 dtype: str = "float32", logprobs_mode: str = "processed_logprobs", version: int = 0,
                 grammar: dict | None = None, environment: Environment | None = None, max_images: int = 8,
                 **engine):
        """`engine`: EngineSettings fields (max_model_len, kv_cache_gb, ...; RunConfig.engine_args gives the run's)."""
        settings = EngineSettings.model_validate(engine)
        prepare_engine_process(threads)
        from vllm import LLM

        model_path = local_checkpoint(model_path)  # a checkpoint on a run's storage: fetched to this node first
        self.device = accelerator()
        # A multimodal policy (Qwen2-VL family): images per prompt (the task's and the environment's), no video.
        self.vision = ImageTokens.for_model(model_path)
        self.llm = LLM(**engine_args(model_path, settings, device=self.device, dtype=dtype, seed=seed,
                                     tensor_parallel_size=tensor_parallel_size,
                                     max_images=max_images if self.vision is not None else None,
                                     logprobs_mode=logprobs_mode))
        self.tokenizer = self.llm.get_tokenizer()
        self.llm.collective_rpc(quiet_reload_notices)
        self.runner = EpisodeRunner(self.llm.llm_engine, self.tokenizer, Grammar.model_validate(grammar or {}),
                                    environment, self.vision)
        self._label_weights(version)  # self.version: the learner version whose weights the engine holds
        self.streamed: dict[int, list[Episode]] = {}  # fully asynchronous rollouts: group -> its episodes in the pool

    def ready(self) -> dict:
        return {"device": self.device, "version": self.version, "pid": os.getpid()}

    def chat_prompt_ids(self, messages: list[dict]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages)

    def generate(self, prompt_ids: list[list[int]], sampling: dict, seeds: list[int],
                 images: list[list] | None = None) -> list[dict]:
        """One sample per prompt, each with its own seed (so results do not depend on batching or on which
        worker runs them). Returns token ids, their log-probabilities and the finish reason per sample. `images[i]`:
        the images of prompt i, whose ids hold their full pad runs (as a trajectory's do). A multimodal policy stops
        at an image token, which is dropped (finish reason "vision_token"), as in an episode."""
        from vllm import SamplingParams

        if self.vision:
            sampling = {**sampling, "stop_token_ids": sorted(set(sampling.get("stop_token_ids") or []) |
                                                             set(self.vision.special_ids))}
        params = [SamplingParams(**sampling, seed=s, logprobs=0, skip_special_tokens=False,
                                 include_stop_str_in_output=True) for s in seeds]
        outputs = self.llm.generate(self.engine_prompts(prompt_ids, images), params, use_tqdm=False)
        results = []
        for out in outputs:
            generation = Generation.from_vllm(out.outputs[0])
            if generation.cut_at_image_token(self.vision):
                results.append({"ids": generation.ids, "logprobs": generation.logprobs, "finish_reason": "vision_token",
                                "text": self.tokenizer.decode(generation.ids, skip_special_tokens=False)})
                continue
            results.append({"ids": generation.ids, "logprobs": generation.logprobs, "text": generation.text,
                            "finish_reason": generation.finish_reason or "length"})
        return results

    def engine_prompts(self, sequences: list[list[int]], images: list[list] | None) -> list:
        """vLLM's prompts of `sequences[i]` with `images[i]` (:func:`actors.episode.engine_prompt`)."""
        from vllm import TokensPrompt

        return [TokensPrompt(**engine_prompt(s, im or [], self.vision))
                for s, im in zip(sequences, images or [None] * len(sequences))]

    def rollout(self, tasks: list[dict], groups: list[int], group_size: int, sampling: dict,
                seed: int, grammar: dict | None = None,
                hooks: list[RolloutHook] = ()) -> tuple[list[Trajectory], RolloutSummary]:
        """`group_size` episodes of each task, single- or multi-turn as the grammar says (`grammar`: this stage's,
        when it differs from the one the worker started with). Sample j of group g uses seed hash(seed, g, j), so a
        step's samples are reproducible whatever the worker count. `hooks`: the recipe's rollout hooks
        (actors/hooks.py); the numbers they return are summed into the summary's `hook_stats`."""
        if grammar is not None and Grammar.model_validate(grammar) != self.runner.grammar:
            self.runner.grammar = Grammar.model_validate(grammar)
        prompts = [task_prompt(task, self.tokenizer, self.vision) for task in tasks]

        def episode(i: int, j: int) -> Episode:
            ids, images, grids = prompts[i]
            return Episode(task=tasks[i], group=groups[i], seed=derive_seed(seed, groups[i], j), prompt_ids=ids,
                           images=list(images), image_grids=list(grids))

        base = min((h.base_samples(group_size) for h in hooks), default=group_size)
        by_group = [[episode(i, j) for j in range(base)] for i in range(len(tasks))]
        self.runner.top_logprobs = max((h.top_logprobs for h in hooks), default=0)
        stats = self.runner.run([ep for group in by_group for ep in group], sampling)
        batch = RolloutBatch(by_group, [len(images) for _, images, _ in prompts], group_size, seed, episode)
        hook_stats, extra = {}, []
        for hook in hooks:
            added, numbers = hook.extend(self, batch)
            extra += added
            hook_stats.update(numbers)
        if extra:
            second = self.runner.run(extra, sampling)
            stats = {k: stats[k] + second[k] for k in stats}
        if any(len(group) != group_size for group in by_group):
            raise RuntimeError(f"rollout hooks {[type(h).__name__ for h in hooks]} left groups of "
                               f"{sorted({len(g) for g in by_group})} samples, not group_size {group_size}")
        trajectories = [ep.to_trajectory(self.tokenizer, self.version) for group in by_group for ep in group]
        for hook in hooks:
            hook_stats.update(hook.finish(self, trajectories))
        summary = RolloutSummary(**shape(trajectories), env_calls=stats["env_calls"], env_errors=stats["env_errors"],
                                 idle_s=stats["idle_s"], seconds=stats["seconds"], version=self.version,
                                 peak_memory_gb=step_peak_memory(), hook_stats=hook_stats)
        return trajectories, summary

    def stream(self, call: RolloutCall, seconds: float):
        """Fully asynchronous rollouts: admit `call`'s groups to the episode pool, run the pool for about `seconds`
        (or until it is empty), and yield each group that ended as a list of trajectories, then a SliceSummary whose
        `groups` describes them, in the order yielded: each group's index, its oldest weight version and whether its
        tokens span several versions (a partial rollout: the weights changed while it was sampled). Episodes go on
        across calls; a weight update between calls reaches those in flight."""
        if self.vision is not None:
            raise ValueError("async=fully_async does not run multimodal policies: the engine's image cache cannot "
                             "be reset while episodes are in flight; use sync or one_step_off")
        if call.grammar is not None and Grammar.model_validate(call.grammar) != self.runner.grammar:
            if self.streamed:
                raise RuntimeError("the grammar changed while streamed episodes were in flight")
            self.runner.grammar = Grammar.model_validate(call.grammar)
        for task, group in zip(call.tasks, call.groups):
            ids, images, grids = task_prompt(task, self.tokenizer, self.vision)
            self.streamed[group] = [Episode(task=task, group=group, seed=derive_seed(call.seed, group, j),
                                            prompt_ids=ids, images=list(images), image_grids=list(grids))
                                    for j in range(call.group_size)]
            self.runner.admit(self.streamed[group], call.sampling)
        start, done = time.perf_counter(), set()
        for ep in self.runner.advance(seconds):
            done.add(ep.group)
        groups = []
        for group in sorted(g for g in done if all(ep.finish_reason for ep in self.streamed[g])):
            trajectories = [ep.to_trajectory(self.tokenizer, self.version) for ep in self.streamed.pop(group)]
            yield trajectories
            groups.append(GroupSummary(group=group, version=min(t.weight_version for t in trajectories),
                                       partial=any(len({v for v, m in zip(t.versions, t.loss_mask) if m}) > 1
                                                   for t in trajectories),
                                       env_calls=sum(len(t.turns) for t in trajectories), **shape(trajectories)))
        stats = self.runner.take_stats()
        yield SliceSummary(groups=groups, in_flight=len(self.streamed), env_errors=stats["env_errors"],
                           idle_s=stats["idle_s"], seconds=time.perf_counter() - start,
                           peak_memory_gb=step_peak_memory())

    def drop_stream(self) -> int:
        """Abandon the streamed groups in flight; returns how many."""
        dropped = len(self.streamed)
        self.runner.abandon()
        self.streamed = {}
        return dropped

    def prompt_logprobs(self, sequences: list[list[int]], images: list[list] | None = None) -> list[list[float]]:
        """log p(token_t | tokens_<t) under the engine's current weights, for t >= 1 of each sequence.
        `images[i]`: the images of sequence i (a trajectory's `images`; its ids hold their full pad runs)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        outs = self.llm.generate(self.engine_prompts(sequences, images), params, use_tqdm=False)
        return [[lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], s[1:])] for o, s in zip(outs, sequences)]

    def update_weights(self, manifest: WeightManifest) -> float:
        """Load weights of `manifest.version` from the object store into every shard, bucket by bucket (each bucket
        read once here, then sent to every shard). Returns the seconds taken."""
        start = time.perf_counter()
        self.llm.collective_rpc(begin_reload, args=(manifest.complete,))
        for bucket in receive_buckets(manifest):
            self.llm.collective_rpc(load_weights, args=(bucket,))
        self.llm.collective_rpc(finish_reload)
        return self._after_reload(manifest.version, start)

    def join_broadcast_group(self, host: str, port: int, world_size: int, first_rank: int) -> list[int]:
        """Every shard joins the weight-broadcast group, as ranks first_rank .. first_rank + shards - 1; returns
        them."""
        return self.llm.collective_rpc(join_broadcast, args=(host, port, world_size, first_rank))

    def receive_broadcast(self, version: int, meta: list, complete: bool = True) -> float:
        """Load weights of `version` as learner rank 0 broadcasts them (`complete`: all of them, else only those that
        changed); every shard receives them itself. Returns the seconds taken."""
        start = time.perf_counter()
        self.llm.collective_rpc(load_broadcast, args=(meta, complete))
        return self._after_reload(version, start)

    def _after_reload(self, version: int, start: float) -> float:
        """Drop what was cached under the old weights: image embeddings (vLLM's advice; without this the next image
        request failed: "Encoder cache miss"), and prefixes, which a new cache salt also keeps apart while streamed
        episodes hold cache blocks (vLLM resets its prefix cache only when no request runs)."""
        if not self.runner.busy():
            self.llm.reset_prefix_cache()
            if self.vision is not None:
                self.llm.llm_engine.reset_encoder_cache()
        self._label_weights(version)
        return time.perf_counter() - start

    def _label_weights(self, version: int) -> None:
        """Tokens sampled from now on carry `version` (vLLM's weight-version spans), and new requests reuse only
        prefixes cached under it."""
        self.version = version
        self.llm.llm_engine.set_weight_version(str(version))
        self.runner.cache_salt = f"weights-{version}"

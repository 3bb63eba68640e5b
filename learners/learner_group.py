"""LearnerGroup: K Ray actors training the policy with DeepSpeed (ZeRO-2/3), gloo on CPU and NCCL on GPU."""
from __future__ import annotations

import logging
import math
import os
import socket
import time

import ray
import torch

from actors.image_tokens import ImageTokens
from cluster.devices import (accelerator, allocator_env, fast_bfloat16, init_deepspeed_distributed, pin_threads,
                             release_freed_memory, resolve_compute_dtype)
from cluster.ray_session import ACTOR_LOST, wait_until_ready
from learners import algorithm as algo
from learners.batches import forward_logp, image_inputs, load_causal_lm, lr_lambda, pad_batch
from learners.checkpoint import checksums
from tasks.storage import Storage, split_checkpoint_uri, upload_share

log = logging.getLogger("medray.learner")


@ray.remote(max_restarts=0)
class LearnerWorker:
    """One DeepSpeed rank. Every rank receives the whole batch's refs and trains on its contiguous shard."""

    def __init__(self, rank: int, world_size: int, threads: int):
        pin_threads(threads)
        self.rank, self.world_size = rank, world_size
        self.device = accelerator()

    def address(self) -> tuple[str, int]:
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def setup(self, master: tuple[str, int], model_path: str, cfg: dict, total_updates: int,
              with_reference: bool) -> str:
        os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK="0",
                          DS_ACCELERATOR="cuda" if self.device == "cuda" else "cpu")
        import deepspeed
        init_deepspeed_distributed(self.device)

        self.cfg = cfg
        learner, model_cfg = cfg["learner"], cfg["model"]
        dtype = getattr(torch, model_cfg["dtype"])
        self.compute_dtype = getattr(torch, resolve_compute_dtype(learner["compute_dtype"], self.device))
        if self.compute_dtype == torch.bfloat16 and not fast_bfloat16(self.device):
            log.warning("learner.compute_dtype=bfloat16 on a %s without native bfloat16 (no AVX512-BF16/AMX): its "
                        "matmuls are emulated and far slower than float32", self.device)
        model = load_causal_lm(model_path, dtype)
        if learner["gradient_checkpointing"]:
            model.gradient_checkpointing_enable()
        self.micro_batches = 1  # per optimizer step; set from each batch's size (stages may differ)
        self.lr = learner["lr"]  # the schedule's base; a stage may set its own
        optimizer = torch.optim.AdamW(model.parameters(), lr=learner["lr"], betas=tuple(learner["betas"]),
                                      weight_decay=learner["weight_decay"])
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_lambda(learner["lr_schedule"], learner["warmup_steps"], total_updates))
        ds_config = {
            "train_micro_batch_size_per_gpu": learner["micro_batch_size"],
            "gradient_accumulation_steps": self.micro_batches,
            "train_batch_size": learner["micro_batch_size"] * self.micro_batches * self.world_size,
            "gradient_clipping": learner["max_grad_norm"],
            "zero_optimization": {"stage": learner["zero_stage"]},
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": model_cfg["dtype"] == "bfloat16"},
            "fp16": {"enabled": model_cfg["dtype"] == "float16"},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=ds_config)
        self.reference = None
        if with_reference:  # some stage has a KL term
            self.reference = load_causal_lm(model_path, dtype).to(self.device).eval().requires_grad_(False)
        self.pad_id = self.engine.module.config.get_text_config().pad_token_id or 0
        self.vision = ImageTokens.for_model(model_path)  # the image processor the rollout engines use, or None
        return str(self.compute_dtype).removeprefix("torch.")

    def train(self, trajectory_refs: list, advantages: list[float] | None, algorithm: dict, objective: str,
              temperature: float, lr: float, mini_batch_size: int | None = None) -> dict:
        """`updates_per_batch` passes over the batch, one optimizer step per mini-batch (the whole batch when
        `mini_batch_size` is None), with the GRPO objective (rollouts and their advantages) or the SFT one
        (demonstrations); each rank trains on its contiguous shard of every mini-batch. Returns sums for exact
        aggregation."""
        start = time.perf_counter()
        trajs = [t for chunk in ray.get(trajectory_refs) for t in chunk]
        alg, micro = algorithm, self.cfg["learner"]["micro_batch_size"]
        mode = "token_mean" if objective == "sft" else alg["loss_agg"]
        all_adv = torch.tensor(advantages) if objective == "grpo" else None
        if lr != self.lr:  # a stage with its own learning rate: the schedule continues, scaled to it, from now
            schedule = self.engine.lr_scheduler
            schedule.base_lrs = [lr] * len(schedule.base_lrs)
            for group, factor in zip(schedule.optimizer.param_groups, schedule.lr_lambdas):
                group["lr"] = lr * factor(schedule.last_epoch)
            self.lr = lr
        stats = {"loss": 0.0, "mask_sum": 0.0, "clip_sum": 0.0, "kl_sum": 0.0, "entropy_sum": 0.0,
                 "grad_norm": 0.0}
        self.engine.train()
        parts = algo.mini_batches(len(trajs), mini_batch_size if objective == "grpo" else None)
        passes = alg["updates_per_batch"] if objective == "grpo" else 1
        for _ in range(passes):
            for part in parts:
                mini = trajs[part]
                # The loss divides by the mini-batch's global count, so every token (token_mean) or sequence
                # (seq_mean, token_sum_norm) weighs the same whatever the rank and micro-batch it lands in.
                denominator = algo.loss_denominator(mode, [t.num_policy_tokens for t in mini],
                                                    alg["loss_norm_length"])
                per_rank = len(mini) // self.world_size
                lo = self.rank * per_rank
                # micro-batches of similar lengths pad less; the loss is a sum over them, so order does not matter
                order = sorted(range(lo, lo + per_rank),
                               key=lambda i: len(mini[i].prompt_ids) + len(mini[i].response_ids))
                shard = [mini[i] for i in order]
                shard_adv = all_adv[part][order] if all_adv is not None else None
                self._set_accumulation(math.ceil(len(shard) / micro))
                for m in range(self.micro_batches):
                    batch = pad_batch(shard[m * micro:(m + 1) * micro], self.pad_id, self.vision)
                    batch = {k: v.to(self.device) for k, v in batch.items()}
                    logp, entropy = forward_logp(self.engine, batch, with_entropy=True,
                                                 temperature=temperature if objective == "grpo" else 1.0,
                                                 compute_dtype=self.compute_dtype)
                    if objective == "sft":
                        loss, s = algo.sft_loss(logp, batch["mask"], global_denominator=denominator)
                    else:
                        ref_logp = None
                        if self.reference is not None:
                            with torch.no_grad():
                                ref_logp, _ = forward_logp(self.reference, batch, with_entropy=False,
                                                           temperature=temperature, compute_dtype=self.compute_dtype)
                        adv = shard_adv[m * micro:(m + 1) * micro].to(self.device)
                        loss, s = algo.grpo_loss(logp, batch["old_logp"], adv, batch["mask"], eps_low=alg["eps_low"],
                                                 eps_high=alg["eps_high"], loss_agg=mode, ref_logp=ref_logp,
                                                 kl_beta=alg["kl_beta"], global_denominator=denominator,
                                                 norm_length=alg["loss_norm_length"])
                    # DeepSpeed averages gradients over ranks; scaling by world size makes the sum of all ranks'
                    # micro-batch losses the mini-batch loss.
                    self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
                    self.engine.step()
                    stats["loss"] += loss.item()
                    stats["entropy_sum"] += (entropy * batch["mask"]).sum().item()
                    for k in ("mask_sum", "clip_sum", "kl_sum"):
                        stats[k] += s[k]
                stats["grad_norm"] += float(self.engine.get_global_grad_norm() or 0.0)
        stats["optimizer_steps"] = passes * len(parts)
        stats["grad_norm"] /= stats["optimizer_steps"]  # the mean over this batch's optimizer steps
        stats["lr"] = self.engine.get_lr()[0]
        release_freed_memory()  # the batch's activations, reused across its micro-batches, go back to the kernel
        stats["seconds"] = time.perf_counter() - start
        return stats

    def _set_accumulation(self, micro_batches: int) -> None:
        """DeepSpeed steps the optimizer every `micro_batches` backwards; batches (and stages) may differ in size."""
        if micro_batches != self.micro_batches:
            self.engine.set_train_batch_size(self.cfg["learner"]["micro_batch_size"] * micro_batches * self.world_size)
            self.micro_batches = micro_batches

    def named_weights(self):
        """(name, full tensor) for every parameter; under ZeRO-3 all ranks must iterate together."""
        module = self.engine.module
        zero3 = self.cfg["learner"]["zero_stage"] == 3
        import deepspeed
        for name, param in module.named_parameters():
            if zero3:
                with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                    yield name, param.detach().clone()
            else:
                yield name, param.detach()

    def help_gather(self) -> None:
        """What ranks other than 0 do while rank 0 reads the weights: take part in ZeRO-3's gathers."""
        for _ in self.named_weights():
            pass

    def publish_weights(self, version: int, bucket_mb: float):
        """Rank 0 puts the weights into the object store and returns (manifest, seconds)."""
        from cluster.weight_sync import WeightPublisher
        start = time.perf_counter()
        if not hasattr(self, "publisher"):
            self.publisher = WeightPublisher(bucket_mb)
        manifest = self.publisher.publish(self.named_weights(), version)
        return manifest, time.perf_counter() - start

    def weight_meta(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, shape) of every parameter, in broadcast order (rank 0; the full shapes under ZeRO-3)."""
        module = self.engine.module
        shapes = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in module.named_parameters()}
        return [(n, str(p.dtype).removeprefix("torch."), shapes[n]) for n, p in module.named_parameters()]

    def join_broadcast_group(self, host: str, port: int, world_size: int) -> None:
        from cluster.weight_sync import join_broadcast_group
        self.broadcast_group = join_broadcast_group(host, port, world_size, 0, self.device)

    def broadcast_weights(self) -> float:
        """Rank 0 broadcasts every parameter to the rollout workers; returns the seconds taken."""
        from cluster.weight_sync import broadcast_weights
        start = time.perf_counter()
        broadcast_weights(self.broadcast_group, self.named_weights())
        return time.perf_counter() - start

    def sequence_logprobs(self, sequences: list[list[int]], images: list[list] | None = None) -> list[list[float]]:
        """log p(token_t | tokens_<t) at temperature 1 under the current weights, for t >= 1, computed in the
        weights' dtype (no autocast: the fidelity check compares weights, not the learner's compute rounding).
        `images[i]`: the images of sequence i (a trajectory's `images`)."""
        self.engine.eval()
        out = []
        with torch.no_grad():
            for seq, seq_images in zip(sequences, images or [[]] * len(sequences)):
                ids = torch.tensor([seq], device=self.device)
                pixels = {k: v.to(self.device) for k, v in image_inputs(ids, seq_images, self.vision).items()}
                logits = self.engine.module(input_ids=ids, **pixels).logits[:, :-1].float()
                out.append(algo.token_logprobs(logits, ids[:, 1:]).squeeze(0).tolist())
        return out

    def save(self, checkpoint_dir: str) -> None:
        """DeepSpeed state (weights, optimizer, scheduler) on every rank; rank 0 also writes the HF model there."""
        self.engine.save_checkpoint(checkpoint_dir, tag="deepspeed", save_latest=False)
        if self.rank != 0:
            return self.help_gather()
        weights = {name: tensor.cpu() for name, tensor in self.named_weights()}
        self.engine.module.save_pretrained(checkpoint_dir, state_dict=weights, safe_serialization=True)

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def share(self, checkpoint_dir: str) -> dict[str, str]:
        """{file: sha256} of what this node holds of a checkpoint being written (none: nothing here)."""
        return checksums(checkpoint_dir) if os.path.isdir(checkpoint_dir) else {}

    def upload_share(self, checkpoint_dir: str, names: list[str], destination: str) -> None:
        upload_share(checkpoint_dir, names, destination)

    def load(self, checkpoint_dir: str, source: str | None = None) -> None:
        """Resume from `checkpoint_dir`, fetched first from `source` (its URI on storage) when this node lacks it."""
        if source is not None:
            location, step = split_checkpoint_uri(source)
            Storage(location).fetch(step, checkpoint_dir, trust_present=True)
        path, _ = self.engine.load_checkpoint(checkpoint_dir, tag="deepspeed", load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {checkpoint_dir}")

    def shutdown(self) -> None:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


class LearnerRankFailed(RuntimeError):
    """A learner rank raised or died; the group is stopped and the run must resume from its last checkpoint."""


def gather_ranks(calls: list, ranks: list, what: str) -> list:
    """`ray.get` of one call per rank that fails fast. A rank that raises or dies leaves the others blocked in a
    collective (allreduce, gather) until gloo's or NCCL's timeout, 30 minutes; a plain `ray.get` in rank order
    would wait on a blocked rank first. So the first failure kills every rank and raises, naming the rank."""
    rank_of = {ref: i for i, ref in enumerate(calls)}
    pending = list(calls)
    while pending:
        (done,), pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(done)
        except Exception as err:
            for r in ranks:
                ray.kill(r, no_restart=True)
            raise LearnerRankFailed(
                f"LearnerWorker-{rank_of[done]} failed during {what}: {type(err).__name__}: {err}\n"
                "The other learner ranks were waiting for it in a collective, so the learner group was stopped. "
                "Checkpoints already written are intact: rerun with resume=true.") from err
    return ray.get(calls)


def optimizer_steps_per_batch(stage_cfg) -> int:
    """Optimizer steps one GRPO rollout batch makes: passes x mini-batches."""
    batch = stage_cfg.rollout.prompts_per_step * stage_cfg.rollout.group_size
    return stage_cfg.algorithm.updates_per_batch * (batch // (stage_cfg.learner.mini_batch_size or batch))


class LearnerGroup:
    """The driver's handle on the K DeepSpeed ranks: fans calls out and combines their answers. Every call that
    all ranks join goes through `gather_ranks`, so one failing rank stops the run instead of hanging it."""

    def __init__(self, cfg, placement, model_path: str, resume_from=None, resume_source: str | None = None):
        res = cfg.cluster.learner
        self.cfg = cfg
        allocator = {"runtime_env": {"env_vars": env}} if (env := allocator_env()) else {}
        self.ranks = [LearnerWorker.options(**placement.options("learner", i, f"LearnerWorker-{i}"),
                                            **allocator).remote(i, res.num, res.threads) for i in range(res.num)]
        master = ray.get(self.ranks[0].address.remote())
        stages = [(stage, cfg.for_stage(i)) for i, stage in enumerate(cfg.stage_plan())]
        total_updates = sum(stage.steps * optimizer_steps_per_batch(stage_cfg) if stage.kind == "grpo" else stage.steps
                            for stage, stage_cfg in stages)
        with_reference = any(stage.kind == "grpo" and stage_cfg.algorithm.kl_beta > 0 for stage, stage_cfg in stages)
        self.compute_dtype = self._all([r.setup.remote(master, model_path, cfg.dump(), total_updates, with_reference)
                                        for r in self.ranks], "setup")[0]
        log.info("learner ranks compute in %s (learner.compute_dtype=%s)", self.compute_dtype,
                 cfg.learner.compute_dtype)
        if resume_from is not None:
            self._all([r.load.remote(str(resume_from), resume_source) for r in self.ranks], "resume")
        self.nodes = ray.get([r.node.remote() for r in self.ranks])  # which rank uploads which checkpoint share

    def train(self, trajectory_refs: list, advantages: list[float] | None, stage_cfg, objective: str = "grpo") -> dict:
        """One batch on every rank: rollouts with their advantages (grpo) or demonstrations (sft)."""
        algorithm = stage_cfg.algorithm.model_dump()
        algorithm["loss_norm_length"] = algorithm["loss_norm_length"] or stage_cfg.rollout.max_new_tokens
        per_rank = self._all([r.train.remote(trajectory_refs, advantages, algorithm, objective,
                                             stage_cfg.rollout.temperature, stage_cfg.learner.lr,
                                             stage_cfg.learner.mini_batch_size) for r in self.ranks],
                             f"a {objective} step")
        summed = {k: sum(p[k] for p in per_rank) for k in ("loss", "mask_sum", "clip_sum", "kl_sum", "entropy_sum")}
        # Each rank's loss is its share of a mini-batch loss; per optimizer step they add up to it.
        summed["loss"] /= per_rank[0]["optimizer_steps"]
        return {**summed, "grad_norm": per_rank[0]["grad_norm"], "lr": per_rank[0]["lr"],
                "optimizer_steps": per_rank[0]["optimizer_steps"],
                "seconds": max(p["seconds"] for p in per_rank)}

    def _all(self, calls: list, what: str) -> list:
        return gather_ranks(calls, self.ranks, what)

    def connect(self, workers: list) -> None:
        """Set up the weight transport to `workers` (`cluster.weight_sync`; auto: collective with GPUs)."""
        choice = self.cfg.cluster.weight_sync
        self.transport = choice if choice != "auto" else \
            ("collective" if self.cfg.cluster.learner.num_gpus > 0 else "object_store")
        self.workers = workers
        if self.transport == "collective":
            host, port = ray.get(self.ranks[0].address.remote())
            # Every shard of every engine is a rank of its own: worker i's shards are 1 + i * shards onward.
            shards = self.cfg.cluster.rollout.tensor_parallel_size
            world = 1 + len(workers) * shards
            ray.get([self.ranks[0].join_broadcast_group.remote(host, port, world)] +
                    [w.join_broadcast_group.remote(host, port, world, 1 + i * shards) for i, w in enumerate(workers)])
            self.meta = ray.get(self.ranks[0].weight_meta.remote())

    def sync(self, version: int) -> dict:
        """Send the weights of `version` to every rollout worker; all learner ranks take part (ZeRO-3 gathers)."""
        start = time.perf_counter()
        helpers = [r.help_gather.remote() for r in self.ranks[1:]]
        if self.transport == "object_store":
            publish = self.ranks[0].publish_weights.remote(version, self.cfg.cluster.sync_bucket_mb)
            (manifest, send_s), *_ = self._all([publish, *helpers], "weight sync")
            for retries in range(3):  # a worker Ray restarts mid-sync reads the same buckets once it is back
                try:
                    load_s = ray.get([w.update_weights.remote(manifest) for w in self.workers])
                    break
                except ACTOR_LOST:
                    if retries == 2:
                        raise
                    for w in self.workers:
                        wait_until_ready(w)
            del manifest, publish  # the objects are freed as soon as no one holds the manifest
        else:
            retries = 0
            send = self.ranks[0].broadcast_weights.remote()
            receives = [w.receive_broadcast.remote(version, self.meta) for w in self.workers]
            send_s = self._all([send, *helpers], "weight sync")[0]
            load_s = ray.get(receives)
        return {"sync_s": time.perf_counter() - start, "sync_send_s": send_s, "sync_load_s": max(load_s),
                "sync_retries": retries}

    def sequence_logprobs(self, sequences: list[list[int]], images: list[list] | None = None) -> list[list[float]]:
        return self._all([r.sequence_logprobs.remote(sequences, images) for r in self.ranks], "a logprob check")[0]

    def fidelity(self, workers: list, trajectories: ray.ObjectRef, n: int = 4) -> float:
        """Max |engine logprob - learner logprob| over the first `n` of a share of trajectories, on every rollout
        worker, under the weights just synced."""
        sample = ray.get(trajectories)[:n]
        seqs, images = [t.prompt_ids + t.response_ids for t in sample], [t.images for t in sample]
        learner = self.sequence_logprobs(seqs, images)
        return max(abs(e - l) for w in workers
                   for engine, ours in zip(ray.get(w.prompt_logprobs.remote(seqs, images)), learner)
                   for e, l in zip(engine, ours, strict=True))

    def save(self, checkpoint_dir) -> None:
        self._all([r.save.remote(str(checkpoint_dir)) for r in self.ranks], "checkpoint save")

    def shares(self, checkpoint_dir, driver_node: str) -> dict[int, dict[str, str]]:
        """{rank: {file: sha256}} of the checkpoint files each node other than the driver's holds, listed by the
        first rank on that node."""
        firsts = {node: rank for rank, node in reversed(list(enumerate(self.nodes))) if node != driver_node}
        listed = self._all([self.ranks[r].share.remote(str(checkpoint_dir)) for r in firsts.values()], "checkpoint")
        return dict(zip(firsts.values(), listed))

    def upload_shares(self, checkpoint_dir, assigned: dict[int, list[str]], destination: str):
        """Start each rank's upload of its `assigned` files; returns a function that waits for them all."""
        calls = [self.ranks[r].upload_share.remote(str(checkpoint_dir), names, destination)
                 for r, names in assigned.items() if names]
        return lambda: self._all(calls, "checkpoint upload") if calls else None

    def shutdown(self) -> None:
        """Leave the process groups where the ranks are alive (ray.wait: a stopped group's calls fail at once)."""
        calls = [r.shutdown.remote() for r in self.ranks]
        ray.wait(calls, num_returns=len(calls), timeout=60)
        for r in self.ranks:
            ray.kill(r)

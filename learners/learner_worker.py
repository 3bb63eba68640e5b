"""LearnerWorker: one DeepSpeed rank of the learner group (ZeRO-1/2/3; gloo on CPU, NCCL on GPU), as a Ray actor."""
from __future__ import annotations

import logging
import os
import socket
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import ray
import torch

from actors.image_tokens import ImageTokens
from cluster.devices import (accelerator, fast_bfloat16, init_deepspeed_distributed, peak_memory_gb, pin_threads,
                             release_freed_memory, reset_peak_memory, resident_gb, resolve_compute_dtype, shared_gb,
                             tensors_gb)
from cluster.storage import Storage, split_checkpoint_uri, upload_share
from learners import algorithm as algo
from learners.batches import (deal_micro_batches, forward_logp, image_inputs, load_causal_lm, lr_lambda, micro_batch,
                              to_device)
from learners.checkpoint import checksums
from learners.lora import has_adapters, merged_weights, policy, with_adapters

log = logging.getLogger("medray.learner")


@dataclass(frozen=True)
class Objective:
    """How one batch trains: `passes` over it in mini-batches `parts` (one optimizer step each), the loss aggregated
    as `loss_agg` at sampling temperature `temperature`, and `loss(logp, batch, rows, learner_old, denominator)`: one
    micro-batch's loss and statistics (`rows`: its trajectories' indices in the batch; `learner_old`: the learner's
    log-probabilities under the weights that sampled it, where known); `corrects`: the loss uses `learner_old`."""
    passes: int
    parts: list[slice]
    loss_agg: str
    temperature: float
    corrects: bool
    loss: Callable


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
        import transformers  # noqa: F401  the libraries a rank holds before any weights: `memory/learner_process_gb`
        self.process_gb = resident_gb()
        model = load_causal_lm(model_path, dtype)
        if learner["gradient_checkpointing"]:
            # non-reentrant: with LoRA the checkpointed layers' inputs need no gradient, and reentrant
            # checkpointing would then give the adapters none
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if learner["lora"]:
            model = with_adapters(model, **learner["lora"])
        self.micro_batches = 1  # per optimizer step; set from each batch's size (stages may differ)
        self.lr = learner["lr"]  # the schedule's base; a stage may set its own
        trained = [p for p in model.parameters() if p.requires_grad]
        bucket = int(min(5e7, sum(p.numel() for p in trained)))
        optimizer = torch.optim.AdamW(trained, lr=learner["lr"], betas=tuple(learner["betas"]),
                                      weight_decay=learner["weight_decay"])
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_lambda(learner["lr_schedule"], learner["warmup_steps"], total_updates))
        ds_config = {
            "train_micro_batch_size_per_gpu": learner["micro_batch_size"],
            "gradient_accumulation_steps": self.micro_batches,
            "train_batch_size": learner["micro_batch_size"] * self.micro_batches * self.world_size,
            "gradient_clipping": learner["max_grad_norm"],
            # buckets of 5e7 elements (200 MB in float32) instead of DeepSpeed's 5e8: a small model's gradients then
            # never sit whole in one staging buffer beside their partitions; DeepSpeed allocates a whole bucket
            # whatever the gradients' size, so LoRA's adapters get one of their own size
            "zero_optimization": {"stage": learner["zero_stage"], "reduce_bucket_size": bucket,
                                  "allgather_bucket_size": bucket},
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": model_cfg["dtype"] == "bfloat16"},
            "fp16": {"enabled": model_cfg["dtype"] == "float16"},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=ds_config)
        self.policy = policy(self.engine.module)  # the Hugging Face model, computing with the adapters if any
        self.reference = None
        # some stage has a KL term: the reference is a frozen copy of the weights, or with LoRA the same model with
        # its adapters off
        if with_reference and not learner["lora"]:
            self.reference = load_causal_lm(model_path, dtype).to(self.device).eval().requires_grad_(False)
        self.kl_reference = with_reference
        self.pad_id = self.policy.config.get_text_config().pad_token_id or 0
        self.vision = ImageTokens.for_model(model_path)  # the image processor the rollout engines use, or None
        return str(self.compute_dtype).removeprefix("torch.")

    def train(self, trajectory_refs: list, advantages: list[float] | None, algorithm: dict, objective: str,
              temperature: float, lr: float, mini_batch_size: int | None = None) -> dict:
        """`passes` over the batch, one optimizer step per mini-batch, with the GRPO objective (rollouts and their
        advantages) or the SFT one (demonstrations); each rank trains on its share of every mini-batch
        (`deal_micro_batches`). Returns sums for exact aggregation, this rank's peak memory, and what it held as the
        call began: its resident size, the object store's share of it, its tensors' and its process's before the
        model was loaded (`held_gb`)."""
        start = time.perf_counter()
        held = {"resident_gb": resident_gb(), "shared_gb": shared_gb(), "tensors_gb": tensors_gb(),
                "process_gb": self.process_gb}
        reset_peak_memory()
        trajs = [t for chunk in ray.get(trajectory_refs) for t in chunk]
        self._set_lr(lr)
        goal = self._grpo(trajs, advantages, algorithm, temperature, mini_batch_size) if objective == "grpo" \
            else self._sft(trajs)
        plans = [self._plan(trajs[part]) for part in goal.parts]
        # With one optimizer step per batch the learner's behaviour log-probabilities are the first forward's own;
        # with more they are computed once, before any update.
        behaviour = self._behaviour_logprobs(trajs, goal.parts, plans, temperature) \
            if goal.corrects and goal.passes * len(goal.parts) > 1 else {}
        stats = dict.fromkeys(("loss", "mask_sum", "clip_sum", "kl_sum", "entropy_sum", "grad_norm", "tokens",
                               "mismatch_k3_sum", "mismatch_tokens", "mismatch_corrected_sum",
                               "mismatch_max_ratio"), 0.0)
        self.engine.train()
        for p in range(goal.passes):
            for k, part in enumerate(goal.parts):
                mini = trajs[part]
                # The loss divides by the mini-batch's global count, so every token (token_mean) or sequence
                # (seq_mean, token_sum_norm) weighs the same whatever the rank and micro-batch it lands in.
                denominator = algo.loss_denominator(goal.loss_agg, [t.num_policy_tokens for t in mini],
                                                    algorithm["loss_norm_length"])
                self._set_accumulation(len(plans[k]))
                for m, picked in enumerate(plans[k]):
                    batch = to_device(micro_batch([mini[i] for i in picked], self.pad_id, self.vision), self.device)
                    logp, entropy = forward_logp(self.policy, batch, with_entropy=True, temperature=goal.temperature,
                                                 compute_dtype=self.compute_dtype)
                    first_update = p == 0 and k == 0  # the weights that sampled the batch, exactly
                    learner_old = behaviour.get((k, m), logp.detach() if first_update else None)
                    rows = [range(len(trajs))[part][i] for i in picked]
                    loss, s = goal.loss(logp, batch, rows, learner_old, denominator)
                    # DeepSpeed averages gradients over ranks; scaling by world size makes the sum of all ranks'
                    # micro-batch losses the mini-batch loss.
                    self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
                    self.engine.step()
                    stats["loss"] += loss.item()
                    stats["tokens"] += int(batch["input_ids"].numel())
                    stats["entropy_sum"] += (entropy * batch["mask"]).sum().item()
                    for key, value in s.items():
                        stats[key] = max(stats[key], value) if key == "mismatch_max_ratio" else stats[key] + value
                stats["grad_norm"] += float(self.engine.get_global_grad_norm() or 0.0)
        stats["optimizer_steps"] = goal.passes * len(goal.parts)
        stats["grad_norm"] /= stats["optimizer_steps"]  # the mean over this batch's optimizer steps
        stats["lr"] = self.engine.get_lr()[0]
        stats["peak_memory_gb"] = peak_memory_gb()
        stats["held_gb"] = held  # between steps, before this one
        release_freed_memory()  # the batch's activations, reused across its micro-batches, go back to the kernel
        stats["seconds"] = time.perf_counter() - start
        return stats

    def _grpo(self, trajs: list, advantages: list[float], algorithm: dict, temperature: float,
              mini_batch_size: int | None) -> Objective:
        """The policy loss over rollouts: `updates_per_batch` passes in mini-batches, at the sampling temperature."""
        adv = torch.tensor(advantages)
        return Objective(
            passes=algorithm["updates_per_batch"], parts=algo.mini_batches(len(trajs), mini_batch_size),
            loss_agg=algorithm["loss_agg"], temperature=temperature,
            corrects=algorithm["rollout_correction"]["kind"] != "none",
            loss=lambda logp, batch, rows, learner_old, denominator: self._grpo_loss(
                logp, batch, adv[rows].to(self.device), learner_old, algorithm, temperature, denominator))

    @staticmethod
    def _sft(trajs: list) -> Objective:
        """Cross-entropy on demonstrations' policy tokens: one pass, one optimizer step, every token alike."""
        return Objective(passes=1, parts=algo.mini_batches(len(trajs), None), loss_agg="token_mean", temperature=1.0,
                         corrects=False, loss=lambda logp, batch, rows, learner_old, denominator: algo.sft_loss(
                             logp, batch["mask"], global_denominator=denominator))

    def _set_lr(self, lr: float) -> None:
        """A stage with its own learning rate: the schedule continues, scaled to it, from now."""
        if lr == self.lr:
            return
        schedule = self.engine.lr_scheduler
        schedule.base_lrs = [lr] * len(schedule.base_lrs)
        for group, factor in zip(schedule.optimizer.param_groups, schedule.lr_lambdas):
            group["lr"] = lr * factor(schedule.last_epoch)
        self.lr = lr

    def _plan(self, mini: list) -> list[list[int]]:
        """This rank's micro-batches of a mini-batch (indices into it); every rank computes every rank's plan."""
        learner = self.cfg["learner"]
        lengths = [len(t.prompt_ids) + len(t.response_ids) for t in mini]
        return deal_micro_batches(lengths, self.world_size, learner["micro_batch_size"],
                                  learner["max_tokens_per_micro_batch"])[self.rank]

    def _behaviour_logprobs(self, trajs: list, parts: list[slice], plans: list, temperature: float) -> dict:
        """{(mini-batch, micro-batch): the learner's log-probabilities under the weights that sampled them}."""
        out = {}
        with torch.no_grad():
            for k, part in enumerate(parts):
                mini = trajs[part]
                for m, picked in enumerate(plans[k]):
                    batch = to_device(micro_batch([mini[i] for i in picked], self.pad_id, self.vision), self.device)
                    out[(k, m)], _ = forward_logp(self.policy, batch, with_entropy=False,
                                                  temperature=temperature, compute_dtype=self.compute_dtype)
        return out

    def _grpo_loss(self, logp, batch: dict, adv, learner_old, algorithm: dict, temperature: float,
                   denominator: float):
        """The policy loss of one micro-batch (GRPO's token ratio or GSPO's sequence one, `ratio_level`), with the KL
        to the reference and the rollout correction when set, at the ratio's level; the engine-vs-learner mismatch is
        measured wherever the learner's behaviour log-probabilities are known."""
        ref_logp = None
        if self.kl_reference:
            adapters_off = self.engine.module.disable_adapter() if self.reference is None else nullcontext()
            with torch.no_grad(), adapters_off:
                ref_logp, _ = forward_logp(self.reference or self.policy, batch, with_entropy=False,
                                           temperature=temperature, compute_dtype=self.compute_dtype)
        correction, weights, mismatch = algorithm["rollout_correction"], None, {}
        if learner_old is not None:
            weights, mismatch = algo.rollout_correction(learner_old, batch["old_logp"], batch["mask"],
                                                        correction["kind"], correction["cap"], algorithm["ratio_level"])
        old = learner_old if correction["kind"] != "none" else batch["old_logp"]
        loss, s = algo.grpo_loss(logp, old, adv, batch["mask"], eps_low=algorithm["eps_low"],
                                 eps_high=algorithm["eps_high"], loss_agg=algorithm["loss_agg"], ref_logp=ref_logp,
                                 kl_beta=algorithm["kl_beta"], global_denominator=denominator,
                                 norm_length=algorithm["loss_norm_length"], is_weights=weights,
                                 ratio_level=algorithm["ratio_level"])
        return loss, {**s, **mismatch}

    def _set_accumulation(self, micro_batches: int) -> None:
        """DeepSpeed steps the optimizer every `micro_batches` backwards; batches (and stages) may differ in size."""
        if micro_batches != self.micro_batches:
            self.engine.set_train_batch_size(self.cfg["learner"]["micro_batch_size"] * micro_batches * self.world_size)
            self.micro_batches = micro_batches

    def named_weights(self, synced: bool = False):
        """(name, full tensor) for every parameter, named as in the model's checkpoint; with LoRA the merged
        weights, and `synced` just those the adapters change (what a weight sync sends). Under ZeRO-3 all ranks
        must iterate together."""
        if has_adapters(self.engine.module):
            yield from merged_weights(self.policy, changed_only=synced)
            return
        zero3 = self.cfg["learner"]["zero_stage"] == 3
        import deepspeed
        for name, param in self.policy.named_parameters():
            if zero3:
                with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                    yield name, param.detach().clone()
            else:
                yield name, param.detach()

    def help_gather(self) -> None:
        """What ranks other than 0 do while rank 0 reads the weights: take part in ZeRO-3's gathers."""
        if self.cfg["learner"]["zero_stage"] == 3:
            for _ in self.named_weights():
                pass

    def publish_weights(self, version: int, bucket_mb: float):
        """Rank 0 puts the weights into the object store and returns (manifest, seconds)."""
        from cluster.weight_sync import WeightPublisher
        start = time.perf_counter()
        if not hasattr(self, "publisher"):
            # pack buffers kept between syncs stay resident through training: not for a lean learner (LoRA, or
            # one that returns what it frees)
            lean = has_adapters(self.engine.module) or not self.cfg["learner"]["keep_freed_memory"]
            self.publisher = WeightPublisher(bucket_mb, keep_buffers=not lean)
        manifest = self.publisher.publish(self.named_weights(synced=True), version,
                                          complete=not has_adapters(self.engine.module))
        return manifest, time.perf_counter() - start

    def weight_meta(self) -> tuple[list[tuple[str, str, tuple[int, ...]]], bool]:
        """(name, dtype, shape) of every tensor a weight sync broadcasts, in its order (rank 0; the full shapes under
        ZeRO-3), and whether those are all the model's weights (not with LoRA: only the layers it changes)."""
        if has_adapters(self.engine.module):
            meta = [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in self.named_weights(True)]
            return meta, False
        params = list(self.policy.named_parameters())
        return [(n, str(p.dtype).removeprefix("torch."), tuple(getattr(p, "ds_shape", p.shape)))
                for n, p in params], True

    def join_broadcast_group(self, host: str, port: int, world_size: int) -> None:
        from cluster.weight_sync import join_broadcast_group
        self.broadcast_group = join_broadcast_group(host, port, world_size, 0, self.device)

    def broadcast_weights(self) -> float:
        """Rank 0 broadcasts every parameter to the rollout workers; returns the seconds taken."""
        from cluster.weight_sync import broadcast_weights
        start = time.perf_counter()
        broadcast_weights(self.broadcast_group, self.named_weights(synced=True))
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
                logits = self.policy(input_ids=ids, **pixels).logits[:, :-1].float()
                out.append(algo.token_logprobs(logits, ids[:, 1:]).squeeze(0).tolist())
        return out

    def save(self, checkpoint_dir: str) -> None:
        """DeepSpeed state (weights, optimizer, scheduler) on every rank; rank 0 also writes the HF model there (with
        LoRA: merged, and the adapters alone under `adapter/`, loadable with PEFT onto model.path)."""
        self.engine.save_checkpoint(checkpoint_dir, tag="deepspeed", save_latest=False)
        if self.rank != 0:
            return self.help_gather()
        weights = {name: tensor.cpu() for name, tensor in self.named_weights()}
        self.policy.save_pretrained(checkpoint_dir, state_dict=weights, safe_serialization=True)
        if has_adapters(self.engine.module):
            self.engine.module.save_pretrained(os.path.join(checkpoint_dir, "adapter"), safe_serialization=True)

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

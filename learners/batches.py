"""What a learner rank computes on, as pure functions: the policy loaded from a directory, rollouts padded into one
batch (targets, loss mask, behaviour log-probabilities, image inputs), the forward's log-probabilities and entropies,
autocast, and the learning-rate schedule."""
from __future__ import annotations

import math

import torch

from actors.image_tokens import ImageTokens
from actors.trajectory import Trajectory
from learners import algorithm as algo


def load_causal_lm(path: str, dtype: torch.dtype):
    """Load a Hugging Face policy from a local directory: text or image-text architecture, by its config."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    config = AutoConfig.from_pretrained(path)
    cls = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    return cls.from_pretrained(path, dtype=dtype, use_safetensors=True)  # never unpickle weights from a path


def image_inputs(input_ids: torch.Tensor, images: list, vision: ImageTokens | None,
                 grids: list | None = None) -> dict[str, torch.Tensor]:
    """The forward's image arguments for `input_ids` [B, L] whose pad runs show `images` (in order): pixels made by
    the processor the rollout engine used, from the same arrays, so the forward sees what vLLM saw. `grids`: the
    patch grids the rollout recorded; another processor would break the token alignment.

    `mm_token_type_ids` (1 on image tokens) is what makes transformers give image tokens their 3-D M-RoPE positions
    (Qwen2-VL); without it the forward silently uses 1-D positions and disagrees with vLLM after the first image.
    """
    if not images:
        return {}
    out = vision.image_processor(images=images, return_tensors="pt")
    if grids is not None and out["image_grid_thw"].tolist() != [list(g) for g in grids]:
        raise ValueError(f"image grids {out['image_grid_thw'].tolist()} differ from the rollout's {grids}: the "
                         "learner's image processor is not the one that made the trajectories")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"],
            "mm_token_type_ids": (input_ids == vision.pad_id).int()}


def model_inputs(batch: dict) -> dict:
    """The forward's keyword arguments of a padded batch (image ones only where it has images)."""
    return {k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw",
                                  "mm_token_type_ids") if k in batch}


def pad_batch(trajs: list[Trajectory], pad_id: int, vision: ImageTokens | None = None) -> dict[str, torch.Tensor]:
    """Right-padded tensors for a micro-batch.

    input_ids [B, L] = prompt + response. Only positions from F = (shortest prompt) - 1 on predict a response token,
    so the targets are tokens F+1..L-1: `mask` [B, L-1-F] is their loss mask (0 on the prompt, environment tokens
    and padding), `old_logp` their behaviour logprobs and `keep` = L - F the positions whose logits the forward must
    compute (:func:`forward_logp`). Trajectories with images add the forward's image arguments (:func:`image_inputs`).
    """
    seqs = [t.prompt_ids + t.response_ids for t in trajs]
    width = max(map(len, seqs))
    first = min(len(t.prompt_ids) for t in trajs) - 1
    input_ids = torch.full((len(trajs), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(trajs), width), dtype=torch.long)
    mask = torch.zeros((len(trajs), width - 1 - first))
    old_logp = torch.zeros((len(trajs), width - 1 - first))
    for i, (t, seq) in enumerate(zip(trajs, seqs)):
        input_ids[i, :len(seq)] = torch.tensor(seq)
        attention[i, :len(seq)] = 1
        start = len(t.prompt_ids) - 1 - first
        mask[i, start:start + len(t.response_ids)] = torch.tensor(t.loss_mask, dtype=torch.float)
        old_logp[i, start:start + len(t.response_ids)] = torch.tensor(t.logprobs)
    images = [im for t in trajs for im in t.images]
    return {"input_ids": input_ids, "attention_mask": attention, "mask": mask, "old_logp": old_logp,
            "keep": torch.tensor(width - first),
            **image_inputs(input_ids, images, vision, [g for t in trajs for g in t.image_grids])}


def forward_logp(module, batch: dict, with_entropy: bool, temperature: float,
                 compute_dtype: torch.dtype | None = None):
    """Logprobs of a `pad_batch`'s targets, [B, L-1-F], and `with_entropy` their entropies where `mask` counts them
    (0 elsewhere). The LM head, log-softmax and entropy run on the `keep` positions that predict response tokens
    only: with prompts much longer than responses (retrieval, images) that is most of a tiny model's learner time, as
    TRL's `logits_to_keep` also found. `compute_dtype`: the model's matmuls under autocast in that dtype; log-softmax
    and entropy stay in float32."""
    keep = int(batch["keep"])
    with autocast(batch["input_ids"].device.type, compute_dtype):
        logits = module(**model_inputs(batch), logits_to_keep=keep).logits[:, :-1].float()
    logp = algo.token_logprobs(logits, batch["input_ids"][:, 1 - keep:], temperature)
    entropy = None
    if with_entropy:  # a statistic of the loss's tokens: padding, prompts and environment text are skipped
        with torch.no_grad():
            counted = batch["mask"].bool()
            entropy = torch.zeros_like(logp)
            entropy[counted] = algo.token_entropy(logits[counted], temperature)
    return logp, entropy


def autocast(device_type: str, compute_dtype: torch.dtype | None):
    """torch.autocast in `compute_dtype`, or a no-op for None / float32."""
    enabled = compute_dtype not in (None, torch.float32)
    return torch.autocast(device_type, dtype=compute_dtype if enabled else None, enabled=enabled)


def lr_lambda(schedule: str, warmup: int, total: int):
    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * progress))
        if schedule == "linear":
            return 1.0 - progress
        return 1.0
    return factor

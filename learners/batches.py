"""What a learner rank computes on, as pure functions: the policy loaded from a directory, a micro-batch's tensors
(sequences packed into one row, or right-padded rows with images; targets, loss mask, behaviour log-probabilities),
how a batch is dealt to ranks and cut into micro-batches, the forward's log-probabilities and entropies computed a
chunk of positions at a time, autocast, and the learning-rate schedule."""
from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from actors.image_tokens import ImageTokens
from actors.trajectory import Trajectory
from learners import algorithm as algo
from learners.attention import use_varlen_attention

#: positions whose logits over the vocabulary exist at once: [512, V] float32 is ~100 MB for a 49k vocabulary
LOGIT_CHUNK = 512


def load_causal_lm(path: str, dtype: torch.dtype):
    """Load a Hugging Face policy from a local directory: text or image-text architecture (medray's where the
    config names one, tasks/vision_arch.py), by its config. Text models attend over packed sequences
    (learners/attention.py)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "vision_config"):
        from tasks.vision_arch_hf import image_text_class
        return image_text_class(config).from_pretrained(path, dtype=dtype, use_safetensors=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True)  # never unpickle weights
    use_varlen_attention(model)
    return model


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


MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "cu_seq_lens_q", "pixel_values", "image_grid_thw",
                "mm_token_type_ids")


def model_inputs(batch: dict) -> dict:
    """The forward's keyword arguments of a micro-batch (packing and image ones only where it has them)."""
    return {k: batch[k] for k in MODEL_INPUTS if k in batch}


def micro_batch(trajs: list[Trajectory], pad_id: int, vision: ImageTokens | None = None) -> dict[str, torch.Tensor]:
    """One micro-batch's tensors.

    Text: every sequence (prompt + response) packed into one row `input_ids` [1, T], `position_ids` restarting at 0
    for each and `cu_seq_lens_q` [n + 1] marking their ends, so attention stays inside a sequence and no token is
    padding. With images: right-padded rows [n, L] with an `attention_mask`, and the forward's image arguments
    (:func:`image_inputs`; Qwen2-VL's 3-D positions are computed per row).

    Per response token j of sequence i, [n, W] with W the longest response: `at` the flat position (row * width +
    column) whose hidden state predicts it, `targets` the token, `mask` its loss mask (0 on environment tokens and
    past the response) and `old_logp` the engine's behaviour log-probability.
    """
    seqs = [t.prompt_ids + t.response_ids for t in trajs]
    images = [im for t in trajs for im in t.images]
    if images:
        width = max(map(len, seqs))
        input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, seq in enumerate(seqs):
            input_ids[i, :len(seq)] = torch.tensor(seq)
            attention[i, :len(seq)] = 1
        starts = [i * width for i in range(len(seqs))]
        inputs = {"input_ids": input_ids, "attention_mask": attention,
                  **image_inputs(input_ids, images, vision, [g for t in trajs for g in t.image_grids])}
    else:
        ends = torch.tensor([len(s) for s in seqs]).cumsum(0)
        starts = [0, *ends[:-1].tolist()]
        inputs = {"input_ids": torch.tensor([[tok for seq in seqs for tok in seq]]),
                  "position_ids": torch.cat([torch.arange(len(s)) for s in seqs]).unsqueeze(0),
                  "cu_seq_lens_q": torch.cat([torch.zeros(1, dtype=torch.int32), ends.to(torch.int32)])}
    width = max(len(t.response_ids) for t in trajs)
    at = torch.zeros((len(trajs), width), dtype=torch.long)
    targets = torch.zeros((len(trajs), width), dtype=torch.long)
    mask, old_logp = torch.zeros((len(trajs), width)), torch.zeros((len(trajs), width))
    for i, t in enumerate(trajs):
        n, first = len(t.response_ids), starts[i] + len(t.prompt_ids) - 1
        at[i, :n] = torch.arange(first, first + n)
        targets[i, :n] = torch.tensor(t.response_ids)
        mask[i, :n] = torch.tensor(t.loss_mask, dtype=torch.float)
        old_logp[i, :n] = torch.tensor(t.logprobs)
    return {**inputs, "at": at, "targets": targets, "mask": mask, "old_logp": old_logp}


def deal_micro_batches(lengths: list[int], world_size: int, micro_batch_size: int,
                       max_tokens: int | None = None) -> list[list[list[int]]]:
    """Each rank's micro-batches, as lists of indices into `lengths` (tokens per sequence), for one mini-batch.

    Every rank gets len / world_size sequences, dealt longest first to the rank with the fewest tokens so far, so
    no rank waits long on another in the gradient collectives. A rank's sequences, longest first, are cut into
    micro-batches of `micro_batch_size` sequences, or with `max_tokens` into micro-batches of at most that many
    tokens (first fit). Every rank makes the same number of micro-batches (under ZeRO-2 each backward is a
    collective): a rank with fewer halves its fullest micro-batch until it has as many.
    """
    per_rank = len(lengths) // world_size
    ranks, tokens = [[] for _ in range(world_size)], [0] * world_size
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = min((r for r in range(world_size) if len(ranks[r]) < per_rank), key=lambda r: tokens[r])
        ranks[r].append(i)
        tokens[r] += lengths[i]
    plans = []
    for seqs in ranks:
        if max_tokens is None:
            plans.append([seqs[lo:lo + micro_batch_size] for lo in range(0, len(seqs), micro_batch_size)])
            continue
        bins, room = [], []
        for i in seqs:
            fit = next((b for b in range(len(bins)) if room[b] >= lengths[i]), None)
            if fit is None:
                bins.append([]), room.append(max_tokens)
                fit = len(bins) - 1
            bins[fit].append(i)
            room[fit] -= lengths[i]
        plans.append(bins)
    count = max(map(len, plans))
    for bins in plans:
        while len(bins) < count:
            fullest = max(range(len(bins)), key=lambda b: len(bins[b]))
            half = len(bins[fullest]) // 2
            bins.append(bins[fullest][half:])
            bins[fullest] = bins[fullest][:half]
    return plans


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def target_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                    with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(head(hidden) / temperature)[target] for hidden states [N, H] and targets [N], in float32, and
    with `with_entropy` the distributions' entropies [N] (no gradient), LOGIT_CHUNK positions at a time. Under
    autograd each chunk is checkpointed: its logits are computed again in backward, so no [N, V] tensor is ever
    whole (values and gradients equal the unchunked computation's)."""
    def chunk(h: torch.Tensor, t: torch.Tensor):
        logits = head(h)
        entropy = None
        if with_entropy:
            with torch.no_grad():
                entropy = algo.token_entropy(logits, temperature)
        return algo.token_logprobs(logits, t, temperature), entropy

    logps, entropies = [], []
    for lo in range(0, len(targets), LOGIT_CHUNK):
        h, t = hidden[lo:lo + LOGIT_CHUNK], targets[lo:lo + LOGIT_CHUNK]
        logp, entropy = checkpoint(chunk, h, t, use_reentrant=False) if torch.is_grad_enabled() else chunk(h, t)
        logps.append(logp)
        entropies.append(entropy)
    if not logps:
        return hidden.new_zeros(0, dtype=torch.float32), (hidden.new_zeros(0) if with_entropy else None)
    return torch.cat(logps), (torch.cat(entropies) if with_entropy else None)


def forward_logp(module, batch: dict, with_entropy: bool, temperature: float,
                 compute_dtype: torch.dtype | None = None):
    """Log-probabilities of a `micro_batch`'s targets, [n, W], and `with_entropy` their entropies; both 0 where
    `mask` is 0. `module` is the Hugging Face policy (a DeepSpeed engine's `.module`): its decoder runs on the whole
    micro-batch, the LM head only on the positions whose targets the loss counts (:func:`target_logprobs`; with
    prompts and retrieved text much longer than what the policy writes that is a small share). `compute_dtype`:
    the matmuls under autocast in that dtype; log-softmax and entropy stay in float32."""
    counted = batch["mask"].bool()
    with autocast(batch["input_ids"].device.type, compute_dtype):
        hidden = module.model(**model_inputs(batch)).last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1])[batch["at"][counted]]
        logp_counted, entropy_counted = target_logprobs(module.get_output_embeddings(), hidden,
                                                        batch["targets"][counted], temperature, with_entropy)
    logp = torch.zeros(counted.shape, dtype=torch.float32, device=counted.device)
    logp[counted] = logp_counted
    entropy = None
    if with_entropy:
        entropy = torch.zeros_like(logp, requires_grad=False)
        entropy[counted] = entropy_counted
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

"""Attention over packed sequences for the learner's forward.

A packed micro-batch is one row [1, T] holding several sequences back to back, each with positions from 0 and their
ends in `cu_seq_lens_q` (the cumulative lengths, as flash-attention's varlen kernels take them). Stock SDPA would
attend over a block-diagonal [T, T] mask, computing every masked-out block; `varlen_sdpa` runs causal SDPA on each
sequence's own slice instead, so the cost stays that of the sequences apart and no token is padding.
"""
from __future__ import annotations

import torch

#: the attention implementation's registered name (transformers' AttentionInterface)
VARLEN = "medray_varlen"


def varlen_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, cu_seq_lens_q: torch.Tensor | None = None, **kwargs):
    """transformers' SDPA attention, sequence by sequence where `cu_seq_lens_q` marks packed sequences.

    query/key/value [1, heads, T, d]; returns ([1, T, heads, d], None) like `sdpa_attention_forward`. Without
    `cu_seq_lens_q` (a padded or single-sequence batch) it is plain SDPA with the mask it was given."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    for unused in ("cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(unused, None)
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    bounds = cu_seq_lens_q.tolist()
    kwargs["is_causal"] = True
    parts = [sdpa_attention_forward(module, query[:, :, lo:hi], key[:, :, lo:hi], value[:, :, lo:hi], None,
                                    **kwargs)[0] for lo, hi in zip(bounds, bounds[1:])]
    return torch.cat(parts, dim=1), None


def use_varlen_attention(model) -> None:
    """Make a text model's attention `varlen_sdpa`. Its mask builder is left unregistered on purpose: transformers
    then passes no mask, which is exact for packed rows (segments) and for right-padded ones (causal attention never
    looks ahead into the padding)."""
    from transformers import AttentionInterface
    AttentionInterface.register(VARLEN, varlen_sdpa)
    model.set_attn_implementation(VARLEN)

"""LoRA RL: the learner trains low-rank adapters on a frozen policy (PEFT), W' = W + (alpha / r) B A (Hu et al.
2021, "LoRA"); rollout engines and checkpoints get the merged weights W', and a weight sync sends only the layers
LoRA changes (every other weight stays what the engines loaded from model.path)."""
from __future__ import annotations

from typing import Iterator

import torch

#: Hugging Face projections that vLLM loads as one fused layer (qkv_proj, gate_up_proj). A reload that brings only some
#: parts of a fused layer rebuilds it with the others missing, so a layer changed by LoRA is synced with its partners.
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
ADAPTER = "default"  # PEFT's name for a model's only adapter


def check_targets(model, target_modules: list[str]) -> None:
    """Refuse `target_modules` that name no linear layer of `model` (PEFT matches them by the layer's last name),
    naming the field and the choices."""
    linear = sorted({name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    missing = [t for t in target_modules if t not in linear]
    if missing:
        raise ValueError(f"learner.lora.target_modules: {missing} name no linear layer of the model; choose among "
                         f"{linear}")


def with_adapters(model, rank: int, alpha: float, dropout: float, target_modules: list[str]):
    """`model` (a Hugging Face policy) with LoRA adapters on its `target_modules`, only those trainable: B starts at
    0, so the merged weights start equal to the model's own."""
    from peft import LoraConfig, get_peft_model

    check_targets(model, target_modules)

    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
                        bias="none")
    return get_peft_model(model, config, adapter_name=ADAPTER)


def has_adapters(module) -> bool:
    return hasattr(module, "peft_config")


def policy(module):
    """The Hugging Face model a rank computes with: a PEFT model's base (its LoRA layers are injected in place, so it
    computes with the adapters), else `module` itself."""
    return module.get_base_model() if has_adapters(module) else module


def lora_layers(model) -> dict[str, torch.nn.Module]:
    from peft.tuners.lora import LoraLayer
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def changed_layers(model) -> set[str]:
    """Names (in `model`) of the layers whose weights LoRA changes, widened to whole fused layers (`FUSED`)."""
    names = set()
    for name in lora_layers(model):
        prefix, _, leaf = name.rpartition(".")
        group = next((g for g in FUSED if leaf in g), (leaf,))
        names.update(f"{prefix}.{part}" if prefix else part for part in group)
    return names


@torch.no_grad()
def merged_weights(model, changed_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of `model`'s parameters (a policy with LoRA layers injected), named as in the model's own
    checkpoint, each LoRA layer's weight merged: W + (alpha / r) B A. `changed_only`: just the `changed_layers`."""
    layers = lora_layers(model)
    changed = changed_layers(model) if changed_only else None
    for name, param in model.named_parameters():
        if ".lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".")
        layer = owner.removesuffix(".base_layer")
        if changed is not None and layer not in changed:
            continue
        tensor = param.detach()
        if layer != owner and leaf == "weight":
            tensor = tensor + layers[layer].get_delta_weight(ADAPTER).to(tensor.dtype)
        yield f"{layer}.{leaf}", tensor

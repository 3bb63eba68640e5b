"""The seeing policy's architecture: Qwen2.5-VL with the patch embedding its config names.

    config.json: {"model_type": "qwen2_5_vl", "architectures": ["MedrayQwen2_5_VLForConditionalGeneration"],
                  "vision_config": {..., "patch_embedding": "conv"}}

Qwen2.5-VL embeds each patch with one linear map (a Conv3d whose kernel is its stride), weighing every pixel position
apart; `conv` is a small CNN max-pooled over the patch (tasks/vision_arch_hf.py, ConvPatchEmbedding), which reads a
lesion alike wherever it lies in the patch (compared in benchmarks/bench_vision_tower.py). A config
without the field is `linear`, loaded by transformers' and vLLM's own classes as before; `model_type` stays
`qwen2_5_vl`, so AutoConfig and Qwen2.5-VL's processors read a `conv` model as they read any other.

Three modules, so that what a config file reads stays free of torch: this one (the names, their check, the vLLM
plugin), tasks/vision_arch_hf.py (the patch embedding, the transformers class the learner trains and the choice of
class that builds or loads a config) and tasks/vision_arch_vllm.py (the class vLLM serves, with the same parameter
names, so checkpoints and weight syncs load through vLLM's own `load_weights`).

vLLM finds the architecture through `register_vllm`, a `vllm.general_plugins` entry point (pyproject.toml): vLLM
calls it in every process that builds an engine, AsyncLLM's engine-core process and its workers included.
"""
from __future__ import annotations

ARCHITECTURE = "MedrayQwen2_5_VLForConditionalGeneration"  # the class name in both transformers and vLLM
PATCH_EMBEDDINGS = ("linear", "conv")


def check_patch_embedding(kind: str, field: str) -> str:
    """`kind` if it is one of PATCH_EMBEDDINGS; else a ValueError naming `field` (where the value came from)."""
    if kind not in PATCH_EMBEDDINGS:
        raise ValueError(f"{field} {kind!r} is not a patch embedding medray builds: one of {list(PATCH_EMBEDDINGS)}")
    return kind


def patch_embedding(config, where: str = "") -> str:
    """The patch embedding a Qwen2.5-VL model's `config` names in its vision_config ('linear' where it names none).
    An unknown one: a ValueError naming the field and the model directory (`where`, else the config's own path)."""
    where = where or config.name_or_path or "a Qwen2.5-VL config"
    return check_patch_embedding(getattr(config.vision_config, "patch_embedding", "linear"),
                                 f"{where}: vision_config.patch_embedding")


def vision_config_entry(kind: str) -> dict:
    """What a vision_config holds to name `kind`: nothing for Qwen's linear embedding, so a linear model's
    config.json stays what transformers writes."""
    return {} if kind == "linear" else {"patch_embedding": kind}


def recorded(fields: dict) -> dict:
    """A build's `fields` (a recipe or tiny config, `patch_embedding` among them) as its cache key records them: the
    patch embedding as a vision_config names it, so builds with Qwen's linear one keep the keys they had before the
    field."""
    rest = {k: v for k, v in fields.items() if k != "patch_embedding"}
    return {**rest, **vision_config_entry(fields["patch_embedding"])}


def register_vllm() -> None:
    """The vLLM plugin: ARCHITECTURE names tasks/vision_arch_vllm.py's class, imported only by an engine whose model
    names it (vLLM's lazy registration)."""
    from vllm import ModelRegistry
    ModelRegistry.register_model(ARCHITECTURE, f"tasks.vision_arch_vllm:{ARCHITECTURE}")

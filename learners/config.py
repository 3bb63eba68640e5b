"""The run configuration: YAML validated into typed objects, with `dotted.key=value` overrides.

Every error names the file, the line (when the key is in the file) and the dotted field.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from actors.environment import Grammar


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ActorResources(Strict):
    num: int = Field(1, ge=1, description="how many actors of this role")
    num_cpus: float = Field(1.0, gt=0)
    num_gpus: float = Field(0.0, ge=0)
    threads: int = Field(1, ge=1, description="torch/OpenMP threads inside each actor")


class ClusterConfig(Strict):
    address: str | None = Field(None, description="Ray address to join; default: RAY_ADDRESS, else start a local Ray")
    host: str = Field("127.0.0.1", description="interface a locally started Ray binds to")
    num_cpus: int | None = Field(None, description="CPUs a locally started Ray offers (default: all)")
    include_dashboard: bool = False
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK"] = "PACK"
    rollout: ActorResources = ActorResources(threads=2)
    learner: ActorResources = ActorResources(num=2, num_cpus=0.25)
    reward: ActorResources = ActorResources(num_cpus=0.25)
    weight_sync: Literal["auto", "object_store", "collective"] = Field(
        "auto", description="learner -> rollout transport; auto: collective (NCCL) with GPUs, else the object store")
    sync_bucket_mb: float = Field(256.0, gt=0, description="object-store bucket size: bounds peak extra memory")


class TinyModelConfig(Strict):
    """A small random-initialised model of a real architecture, built offline by medray."""
    arch: Literal["qwen2", "qwen2_5_vl"] = "qwen2"
    vocab_size: int = Field(1024, ge=300, description="BPE merges target, before special tokens")
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    seed: int = 0

    @model_validator(mode="after")
    def _head_dim(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.hidden_size // self.num_attention_heads < 32:
            raise ValueError("head_dim = hidden_size / num_attention_heads must be >= 32 (vLLM's CPU attention)")
        return self


class ModelConfig(Strict):
    path: str | None = Field(None, description="local Hugging Face model directory; null builds the tiny model")
    tiny: TinyModelConfig = TinyModelConfig()
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class DataConfig(Strict):
    train: str = Field(..., description="JSONL of task records, or 'hpo:<split>' for the built-in HPO tasks")
    shuffle: bool = True
    max_prompt_tokens: int = Field(256, ge=8)


class RolloutConfig(Strict):
    prompts_per_step: int = Field(16, ge=1)
    group_size: int = Field(8, ge=1, description="G rollouts per prompt")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(32, ge=1)
    stop: list[str] = Field(default_factory=list, description="strings that end a generation (kept in the output)")
    kv_cache_gb: float = Field(1.0, gt=0, description="KV-cache size on CPU (on GPU: gpu_memory_utilization)")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    max_model_len: int = 1024
    grammar: Grammar = Grammar()
    fidelity_check_every: int = Field(0, ge=0, description="every N steps compare engine and learner logprobs (0: off)")
    fidelity_tolerance: float = 1e-4


class AlgorithmConfig(Strict):
    eps_low: float = Field(0.2, ge=0)
    eps_high: float = Field(0.28, ge=0, description="> eps_low is DAPO's clip-higher")
    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"
    normalize_std: bool = Field(True, description="false is Dr.GRPO")
    kl_beta: float = Field(0.0, ge=0, description="0 runs no reference model")
    updates_per_batch: int = Field(1, ge=1, description="optimizer steps on each rollout batch")


class LearnerConfig(Strict):
    zero_stage: Literal[2, 3] = 2
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    micro_batch_size: int = Field(8, ge=1, description="sequences per forward/backward on one rank")
    gradient_checkpointing: bool = False


class RewardSpec(Strict):
    name: str
    weight: float = 1.0
    args: dict = Field(default_factory=dict)


class RewardsConfig(Strict):
    components: list[RewardSpec] = Field(..., min_length=1)
    on_error: Literal["fail", "zero"] = Field("fail", description="a failed component fails the step, or scores 0")
    timeout_s: float = Field(120.0, gt=0)


class CheckpointConfig(Strict):
    every: int = Field(10, ge=1)
    keep_last: int = Field(2, ge=1)


class LoggingConfig(Strict):
    tensorboard: bool = True
    progress_bar: bool = True


class RunConfig(Strict):
    output_dir: str
    seed: int = 0
    total_steps: int = Field(..., ge=1)
    resume: bool = False
    async_mode: Literal["sync", "one_step_off"] = Field("sync", alias="async")
    cluster: ClusterConfig = ClusterConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    learner: LearnerConfig = LearnerConfig()
    rewards: RewardsConfig
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)

    @model_validator(mode="after")
    def _batch_divides(self):
        batch = self.rollout.prompts_per_step * self.rollout.group_size
        ranks = self.cluster.learner.num
        if batch % ranks:
            raise ValueError(f"rollout batch {batch} (prompts_per_step x group_size) must divide over "
                             f"{ranks} learner ranks (cluster.learner.num)")
        return self

    def dump(self) -> dict:
        return self.model_dump(mode="json", by_alias=True)


class ConfigError(ValueError):
    """A config that cannot be used; the message names file, line and field."""


def _line_of(node: yaml.Node | None, path: tuple) -> int | None:
    """The 1-based line of `path` (keys and list indices) in a composed YAML node tree."""
    line = None
    for key in path:
        if isinstance(node, yaml.MappingNode):
            match = [(k, v) for k, v in node.value if k.value == str(key)]
            if not match:
                break
            line, node = match[0][0].start_mark.line + 1, match[0][1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            line = node.start_mark.line + 1
        else:
            break
    return line


def parse_override(text: str) -> tuple[list[str], object]:
    """`a.b.c=value` -> (["a", "b", "c"], value parsed as YAML, so 3 -> int, true -> bool, [1,2] -> list)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form dotted.key=value")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({e})") from None
    return key.split("."), value


def load_config(path: str | os.PathLike, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML config, apply `dotted.key=value` overrides, and validate it into a `RunConfig`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read config ({e})") from None
    try:
        root = yaml.compose(text)
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(raw).__name__}")
    overridden = set()
    for text_override in overrides:
        keys, value = parse_override(text_override)
        node = raw
        for k in keys[:-1]:
            if not isinstance(node.get(k, {}), dict):
                raise ConfigError(f"override {text_override!r}: {k!r} is not a section")
            node = node.setdefault(k, {})
        node[keys[-1]] = value
        overridden.add(tuple(keys))
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            loc = tuple(err["loc"])
            where = ".".join(str(p) for p in loc) or "(top level)"
            if any(loc[:len(o)] == o for o in overridden):
                origin = "command-line override"
            else:
                line = _line_of(root, loc)
                origin = f"line {line}" if line else "not set in file"
            problems.append(f"  {where} ({origin}): {err['msg']}")
        raise ConfigError(f"{path}: invalid config\n" + "\n".join(problems)) from None

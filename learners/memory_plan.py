"""Host memory (RAM) of a CPU run, estimated per role from its config before anything starts, and whether the roles
fit one machine under Ray's memory monitor (which kills a worker when the node's used memory passes
`RAY_memory_usage_threshold`, default 0.95).

A learner rank holds its process, its share of weights, gradients and Adam state (`learner_bytes`)
plus DeepSpeed's flat buffers, the gathered copy weight sync sends and the pages its allocator keeps
(BUFFER_BYTES_PER_PARAM; fewer when it returns them, RELEASED_BUFFER_BYTES_PER_PARAM), and at its peak one
micro-batch's activations kept for backward (ACTIVATION_FLOATS x hidden per token and layer; with gradient
checkpointing only each layer's input plus one layer's full set) and one logit chunk with its log-softmax and gradient.
A vLLM rollout worker (or judge) holds its process, its weights with the copies loading and weight sync make
(ENGINE_WEIGHT_COPIES), and its KV cache. The constants are fitted to the runs' own `memory/<role>_peak_gb`
(docs/BENCHMARKS.md, "Memory known before the run"); reward models and tool weights are not estimated.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from cluster.devices import resolve_compute_dtype
from learners.batches import LOGIT_CHUNK
from learners.config import RunConfig
from learners.lora import check_targets
from tasks.model_aliases import resolve_model

log = logging.getLogger("medray.memory")

GB = 1e9
PROCESS_GB = {"learner": 0.7, "rollout": 0.9, "judge": 0.9, "driver": 0.7}  # torch, DeepSpeed / vLLM, Ray imported
SERVICE_GB = 0.4  # a reward, retriever or tool actor without a model of its own
BUFFER_BYTES_PER_PARAM = 23
RELEASED_BUFFER_BYTES_PER_PARAM = 13  # learner.keep_freed_memory false: no freed pages kept, no sync buffers
LORA_SYNC_BYTES_PER_PARAM = 7  # with LoRA: the merged weights a sync computes and sends
ACTIVATION_FLOATS = 35
LORA_ACTIVATION_FLOATS = 23  # frozen layers keep no input for a weight gradient
ENGINE_WEIGHT_COPIES = 6


def model_size(cfg: RunConfig) -> tuple[int, str, object | None]:
    """(parameters, where the number came from, the model's transformers config or None): the model's config.json
    built on the meta device (no weights read), else `model.size_hint_b` (no config), else the tiny model's config."""
    from transformers import AutoConfig

    path = resolve_model(cfg.model.path) if cfg.model.path else None
    if path and (Path(path) / "config.json").is_file():
        config, source = AutoConfig.from_pretrained(path), f"{path}/config.json"
    elif cfg.model.path and cfg.model.size_hint_b:
        return int(cfg.model.size_hint_b * 1e9), f"model.size_hint_b ({cfg.model.path} is not readable here)", None
    elif cfg.model.path:
        raise FileNotFoundError(f"model.path {cfg.model.path} is not readable here: set model.size_hint_b (billions of "
                                f"parameters) for the dry run's memory estimate")
    else:
        from tasks.tiny_models import ensure_tiny_model
        config, source = AutoConfig.from_pretrained(ensure_tiny_model(cfg.model.tiny)), "model.tiny"
    return sum(p.numel() for p in meta_model(config).parameters()), source, config


def meta_model(config):
    """The model of a transformers `config` on the meta device: shapes, no weights."""
    import torch
    from transformers import AutoModelForCausalLM

    cls = AutoModelForCausalLM
    if hasattr(config, "vision_config"):
        from tasks.vision_arch_hf import image_text_class
        cls = image_text_class(config)
    with torch.device("meta"):
        return cls.from_config(config)


def trainable_params(cfg: RunConfig, params: int, model_config) -> int:
    """Parameters the learner trains: all of them, or with `learner.lora` its adapters', rank x (in + out) for each
    target linear layer."""
    import torch

    lora = cfg.learner.lora
    if lora is None:
        return params
    if model_config is None:  # no shapes: LoRA's adapters are ~1% of a model at the usual ranks
        return params // 100
    model = meta_model(model_config)
    check_targets(model, lora.target_modules)
    return sum(lora.rank * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.rpartition(".")[2] in lora.target_modules)


def learner_bytes(params: int, dtype: str, zero_stage: int, ranks: int, reference: bool,
                  trainable: int | None = None) -> float:
    """Bytes per learner rank for weights, gradients and Adam state under ZeRO-`zero_stage` over `ranks`: the
    mixed-precision accounting of Rajbhandari et al. 2020 (ZeRO), per parameter 2 bytes of bf16/fp16 weights and 2 of
    gradients plus 12 of fp32 master weights and Adam moments (fp32 training: 4 + 4 + 8), gradients and optimizer
    state only for the `trainable` ones (default all: LoRA trains its adapters only); `reference` adds a frozen
    copy of the weights (the KL reference) under full fine-tuning (LoRA's reference is its model, adapters off)."""
    half = dtype in ("bfloat16", "float16")
    weights, grads, optim = (2, 2, 12) if half else (4, 4, 8)
    trainable = params if trainable is None else trainable
    reference = reference and trainable == params
    # ZeRO-1 partitions the optimizer state, ZeRO-2 the gradients too, ZeRO-3 the weights too
    state = (grads if zero_stage == 1 else grads / ranks) + optim / ranks
    return params * ((weights if zero_stage < 3 else weights / ranks) + (weights if reference else 0)) \
        + trainable * state


def keeps_reference(cfg: RunConfig) -> bool:
    """Whether a GRPO stage of the run has a KL term, so the learner holds a frozen reference copy of the weights."""
    return any(cfg.for_stage(i).algorithm.kl_beta > 0 for i, s in enumerate(cfg.stage_plan()) if s.kind == "grpo")


def ray_memory_threshold() -> float:
    """The used share of a node's memory above which Ray's memory monitor kills workers."""
    return float(os.environ.get("RAY_memory_usage_threshold", 0.95))


def learner_rank_gb(params: int, layers: int, hidden: int, vocab: int, tokens: int, *, dtype: str = "float32",
                    compute_dtype: str = "float32", zero_stage: int = 2, ranks: int = 1, reference: bool = False,
                    checkpointing: bool = False, trainable: int | None = None,
                    keep_freed: bool = True) -> dict[str, float]:
    """A learner rank's resident memory between steps (`resident`) and its peak training a micro-batch of `tokens`
    packed tokens (`peak`), in GB. `trainable`: with LoRA, the adapters' parameters (the reference is then the
    model with adapters off, no copy). `keep_freed`: learner.keep_freed_memory."""
    lora = trainable is not None and trainable < params
    per_param = BUFFER_BYTES_PER_PARAM if keep_freed else RELEASED_BUFFER_BYTES_PER_PARAM
    buffers = per_param * trainable + LORA_SYNC_BYTES_PER_PARAM * params if lora else per_param * params
    resident = PROCESS_GB["learner"] * GB + buffers \
        + learner_bytes(params, dtype, zero_stage, ranks, reference, trainable)
    act_bytes = 4 if compute_dtype == "float32" else 2
    floats = LORA_ACTIVATION_FLOATS if lora else ACTIVATION_FLOATS
    per_token_layer = hidden * (1 if checkpointing else floats)
    activations = tokens * layers * per_token_layer * act_bytes \
        + (tokens * hidden * floats * act_bytes if checkpointing else 0)
    logits = 3 * min(tokens, LOGIT_CHUNK) * vocab * 4  # float32 logits, log-softmax, their gradient
    return {"resident": resident / GB, "peak": (resident + activations + logits) / GB}


def engine_gb(params: int, engine_dtype: str, kv_cache_gb: float) -> float:
    """A CPU vLLM engine's resident memory in GB (it keeps its KV cache allocated: resident == peak)."""
    weight_bytes = params * (2 if engine_dtype in ("bfloat16", "float16") else 4)
    return (PROCESS_GB["rollout"] * GB + ENGINE_WEIGHT_COPIES * weight_bytes) / GB + kv_cache_gb * 2**30 / GB


def micro_batch_tokens(cfg) -> dict[str, int]:
    """Tokens in one learner micro-batch: `floor`, one sequence at rollout.max_model_len (the least a micro-batch holds
    once a sequence reaches the context limit), and `budget`, the most the config allows
    (learner.max_tokens_per_micro_batch, else micro_batch_size sequences at the context limit)."""
    longest = cfg.rollout.max_model_len
    budget = cfg.learner.max_tokens_per_micro_batch or cfg.learner.micro_batch_size * longest
    return {"floor": longest, "budget": budget}


def host_plan(cfg, params: int, model_config, roles: tuple[str, ...]) -> list[dict]:
    """Rows {role, num, resident_gb, floor_gb, peak_gb}: each actor's memory between steps, while training a
    micro-batch at the floor, and at the config's token budget (`micro_batch_tokens`)."""
    text = getattr(model_config, "text_config", model_config)
    tokens = micro_batch_tokens(cfg)
    kl = keeps_reference(cfg)
    learner = {name: learner_rank_gb(params, text.num_hidden_layers, text.hidden_size, text.vocab_size, n,
                                     dtype=cfg.model.dtype,
                                     compute_dtype=resolve_compute_dtype(cfg.learner.compute_dtype, "cpu"),
                                     zero_stage=cfg.learner.zero_stage, ranks=cfg.cluster.learner.num, reference=kl,
                                     checkpointing=cfg.learner.gradient_checkpointing,
                                     keep_freed=cfg.learner.keep_freed_memory,
                                     trainable=trainable_params(cfg, params, model_config))
               for name, n in tokens.items()}
    rows = [{"role": "driver", "num": 1, "resident_gb": PROCESS_GB["driver"]}]
    for role in roles:
        if role == "learner":
            rows.append({"role": role, "num": cfg.cluster.learner.num, "resident_gb": learner["floor"]["resident"],
                         "floor_gb": learner["floor"]["peak"], "peak_gb": learner["budget"]["peak"]})
        elif role == "rollout":
            rows.append({"role": role, "num": cfg.cluster.rollout.num,
                         "resident_gb": engine_gb(params, cfg.engine_dtype(), cfg.rollout.kv_cache_gb)})
        elif role == "judge" and cfg.judge is not None and cfg.judge.backend == "vllm":
            # the judge's own model is not read here: the policy's size stands in for it
            rows.append({"role": role, "num": cfg.cluster.judge.num,
                         "resident_gb": engine_gb(params, cfg.judge.dtype, cfg.judge.kv_cache_gb)})
        else:
            rows.append({"role": role, "num": getattr(cfg.cluster, role).num, "resident_gb": SERVICE_GB})
    for row in rows:
        row.setdefault("floor_gb", row["resident_gb"])
        row.setdefault("peak_gb", row["floor_gb"])
    return rows


def phase_totals(rows: list[dict], key: str) -> float:
    """The machine's total while the learners train at `key` (floor_gb or peak_gb) and every other role sits at its
    resident size (generation and training do not overlap in a synchronous step; the engines stay resident)."""
    return sum(r["num"] * (r[key] if r["role"] == "learner" else r["resident_gb"]) for r in rows)


BOUNDS = {"learner": "set learner.gradient_checkpointing: true, learner.keep_freed_memory: false, or lower "
                     "learner.max_tokens_per_micro_batch (or learner.micro_batch_size)",
          "rollout": "lower rollout.kv_cache_gb or cluster.rollout.num",
          "judge": "lower judge.kv_cache_gb"}


def fit_problems(rows: list[dict], node_memory_gb: float) -> dict[str, str | None]:
    """What a machine of `node_memory_gb` says to the roles `rows`, each a message naming the largest role and the
    settings that bound it, or None: `cannot_fit`, the roles' resident memory alone exceeds the machine;
    `at_floor`, with the learners at their floor the run passes Ray's memory threshold; `at_budget`, it does so only
    at the token budget. Summed peaks overstate a node's use (pages shared through the object store are counted in
    each process), so only `cannot_fit` stops a run."""
    limit = ray_memory_threshold() * node_memory_gb

    def message(key: str, what: str, total: float, bound: float) -> str:
        largest = max(rows, key=lambda r: r["num"] * r[key])
        shares = ", ".join(f"{r['role']} {r['num']} x {r[key]:.1f}" for r in rows)
        return (f"{what} the run needs ~{total:.1f} GB of host memory ({shares}) against {bound:.1f} GB of this "
                f"{node_memory_gb:.1f} GB machine; the largest role is {largest['role']}: "
                f"{BOUNDS.get(largest['role'], 'give it fewer actors')}")

    totals = {key: phase_totals(rows, key) for key in ("resident_gb", "floor_gb", "peak_gb")}
    problems = {"cannot_fit": None, "at_floor": None, "at_budget": None}
    if totals["resident_gb"] > node_memory_gb:
        problems["cannot_fit"] = message("resident_gb", "between steps", totals["resident_gb"], node_memory_gb)
    elif totals["floor_gb"] > limit:
        problems["at_floor"] = message("floor_gb", "with the learners at one sequence of rollout.max_model_len a "
                                       "micro-batch, Ray's memory monitor may kill a role:", totals["floor_gb"], limit)
    elif totals["peak_gb"] > limit:
        problems["at_budget"] = message("peak_gb", "at its token budget, Ray's memory monitor may kill a role:",
                                        totals["peak_gb"], limit)
    return problems


def check_local_run(cfg, roles: tuple[str, ...]) -> None:
    """Refuse, before Ray starts, a run on a local Ray without GPUs that cannot fit this machine's memory
    (`fit_problems`), and warn when it may pass Ray's memory threshold at its floor; a run that joins a cluster is not
    checked here (its nodes are not known yet)."""
    import psutil

    from cluster.placement import PlacementError

    if cfg.cluster.address or os.environ.get("RAY_ADDRESS") or any(
            getattr(cfg.cluster, role).actor_gpus for role in roles):
        return
    params, _, model_config = model_size(cfg)
    if model_config is None:
        return
    problems = fit_problems(host_plan(cfg, params, model_config, roles), psutil.virtual_memory().total / GB)
    if problems["cannot_fit"]:
        raise PlacementError(problems["cannot_fit"] + " (the estimate: learners/run.py --dry-run)")
    if problems["at_floor"]:
        log.warning(problems["at_floor"])


class NodeWatch:
    """Once a step: the driver's node's used memory (`memory/node_used_fraction`), the share of its CPU time that was
    busy since the last call (`cpu/node_busy_fraction`: near 1, no schedule of the same work runs faster on this
    node), and, the first time memory comes within MARGIN of Ray's memory threshold, a warning naming the role whose
    `memory/<role>_peak_gb` is largest."""
    MARGIN = 0.05

    def __init__(self):
        import psutil

        self.warned = False
        psutil.cpu_percent()  # starts the interval the first step's share is over

    def __call__(self, record: dict) -> dict:
        import psutil

        memory = psutil.virtual_memory()
        used = (memory.total - memory.available) / memory.total
        threshold = ray_memory_threshold()
        if used >= threshold - self.MARGIN and not self.warned:
            self.warned = True
            peaks = {k.removeprefix("memory/").removesuffix("_peak_gb"): v for k, v in record.items()
                     if k.startswith("memory/") and k.endswith("_peak_gb") and "_gpu" not in k}
            role = max(peaks, key=peaks.get) if peaks else None
            log.warning("step %s: this node's memory is %.0f%% used, near Ray's memory threshold (%.0f%%, "
                        "RAY_memory_usage_threshold) above which it kills a worker%s", record.get("step"),
                        100 * used, 100 * threshold, f"; the largest role is {role} at {peaks[role]:.1f} GB an "
                        f"actor: {BOUNDS.get(role, 'give it fewer actors')}" if role else "")
        return {"memory/node_used_fraction": used, "cpu/node_busy_fraction": psutil.cpu_percent() / 100}

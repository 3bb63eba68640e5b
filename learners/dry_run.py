"""Resolve a run without starting it: every stage's config, which actor gets which devices, and memory per device.

    python learners/run.py --config configs/med_rwr_cluster.yaml --dry-run [--gpus-per-node 8 --gpu-memory-gb 80]

Nothing is started and no GPU is needed, so a cluster config is checked on a laptop. Placement follows the
trainer's: one placement group per role, bundle i of a role for actor i, packed onto nodes in role order (Ray's PACK
strategy). GPU memory is the standard mixed-precision accounting (`learners.memory_plan.learner_bytes`); activations
and the CUDA context are not included there: leave headroom. A run without GPUs gets each role's host memory,
activations included (`learners.memory_plan`), and fails the dry run when it cannot fit the machine.

    python learners/run.py --config configs/quickstart.yaml --dry-run [--node-memory-gb 24]
"""
from __future__ import annotations

import json
import math

from learners.config import RunConfig
from learners.memory_plan import (fit_problems, host_plan, keeps_reference, learner_bytes, model_size,
                                  phase_totals, trainable_params)

GiB = 2**30


def device_plan(cfg: RunConfig, roles: tuple[str, ...], gpus_per_node: int,
                others: dict[str, dict[str, float]] | None = None) -> list[dict]:
    """Bundles packed onto nodes in role order, then `others` (tool actors, as `learners.services.tool_demand`
    gives them): each actor's node and GPU indices (fractions share a GPU; a tensor-parallel engine takes a GPU per
    shard, all on one node)."""
    plan, node, gpu_cursor = [], 0, 0.0
    actors = [(role, getattr(cfg.cluster, role).num, getattr(cfg.cluster, role).actor_cpus,
               getattr(cfg.cluster, role).actor_gpus) for role in roles]
    actors += [(field.removeprefix("tools.tools."), d["num"], d["CPU"], d["GPU"]) for field, d in (others or {}).items()]
    for role, num, num_cpus, num_gpus in actors:
        for i in range(num):
            need = num_gpus
            if need and math.ceil(gpu_cursor + need - 1e-9) > gpus_per_node:
                node, gpu_cursor = node + 1, 0.0
            first = math.floor(gpu_cursor + 1e-9)
            gpus = list(range(first, math.ceil(gpu_cursor + need - 1e-9))) if need else []
            plan.append({"actor": f"{role}-{i}", "role": role, "node": node if need else None, "gpus": gpus,
                         "gpu_share": need, "cpus": num_cpus})
            gpu_cursor += need
    return plan


def dry_run(cfg: RunConfig, gpus_per_node: int = 8, gpu_memory_gb: float = 80.0,
            node_memory_gb: float | None = None) -> dict:
    """The run's stages, placement and memory. A run without GPUs also gets each role's host memory
    (`learners.memory_plan`) against a machine of `node_memory_gb` (default: this one's): `errors` when it cannot
    fit, `warnings` when it may pass Ray's memory threshold."""
    from learners.services import service_roles, tool_demand
    from cluster.placement import ROLES

    roles = ROLES + service_roles(cfg)
    params, source, model_config = model_size(cfg)
    stages = [{"name": s.name, "kind": s.kind, "steps": s.steps, **({"set": s.set} if s.set else {})}
              for s in cfg.stage_plan()]
    kl = keeps_reference(cfg)
    weight_bytes = params * (2 if cfg.engine_dtype() in ("bfloat16", "float16") else 4)
    trainable = trainable_params(cfg, params, model_config)
    learner = learner_bytes(params, cfg.model.dtype, cfg.learner.zero_stage, cfg.cluster.learner.num, kl, trainable)
    # vLLM takes gpu_memory_utilization of each of its devices (one per shard) for weights + KV cache, whatever the
    # model's size; a shard holds 1/tensor_parallel_size of the weights.
    shards = cfg.cluster.rollout.tensor_parallel_size
    rollout = cfg.rollout.gpu_memory_utilization * gpu_memory_gb * GiB
    per_role = {"learner": learner / GiB, "rollout": rollout * shards / GiB}
    if cfg.judge is not None and cfg.judge.backend == "vllm":  # vLLM's share of each of its GPUs
        per_role["judge"] = cfg.judge.gpu_memory_utilization * gpu_memory_gb * max(cfg.cluster.judge.actor_gpus, 1)
    placement = device_plan(cfg, roles, gpus_per_node, others=tool_demand(cfg))
    for row in placement:  # reward models are the user's choice: no estimate (None) for them
        known = row["gpus"] and row["role"] in per_role
        row["memory_gib"] = round(per_role[row["role"]], 1) if known else None
    warnings = [f"{row['actor']}: ~{row['memory_gib']} GiB estimated but its GPUs have "
                f"{gpu_memory_gb * max(len(row['gpus']), 1):g} GiB" for row in placement
                if row["memory_gib"] and row["memory_gib"] > gpu_memory_gb * max(len(row["gpus"]), 1)]
    warnings += [f"cluster.{role}: {getattr(cfg.cluster, role).actor_gpus:g} GPUs per actor (tensor_parallel_size x "
                 f"num_gpus) but a node has {gpus_per_node}; the shards of one engine share a node"
                 for role in roles if getattr(cfg.cluster, role).actor_gpus > gpus_per_node]
    if weight_bytes / shards > 0.9 * rollout:
        warnings.append(f"rollout: the weights alone ({weight_bytes / shards / GiB:.1f} GiB per shard) leave little "
                        f"or no KV cache in gpu_memory_utilization x {gpu_memory_gb:g} GiB; raise "
                        f"rollout.gpu_memory_utilization or cluster.rollout.tensor_parallel_size")
    host, errors = [], []
    if not any(row["gpus"] for row in placement) and model_config is not None:
        import psutil
        node_memory_gb = node_memory_gb or psutil.virtual_memory().total / 1e9
        host = host_plan(cfg, params, model_config, roles)
        problems = fit_problems(host, node_memory_gb)
        errors = [problems["cannot_fit"]] if problems["cannot_fit"] else []
        warnings += [w for w in (problems["at_floor"], problems["at_budget"]) if w]
    return {"parameters": params, "parameters_from": source, "stages": stages, "host": host,
            "node_memory_gb": node_memory_gb, "errors": errors,
            "gpus": sum(row["gpu_share"] for row in placement), "nodes": 1 + max(
                [row["node"] for row in placement if row["node"] is not None], default=0),
            "learner_gib_per_rank": round(learner / GiB, 1), "rollout_gib_per_worker": round(per_role["rollout"], 1),
            "placement": placement, "warnings": warnings}


def print_plan(plan: dict) -> None:
    print(f"model: {plan['parameters'] / 1e9:.3f}B parameters ({plan['parameters_from']})")
    for s in plan["stages"]:
        print(f"stage {s['name']} ({s['kind']}, {s['steps']} steps){': ' + json.dumps(s['set']) if 'set' in s else ''}")
    print(f"{'actor':<14} {'node':>4} {'gpus':<12} {'cpus':>5} {'est. GiB':>9}   (reward models: not estimated)")
    for row in plan["placement"]:
        gpus = ",".join(map(str, row["gpus"])) + (f" ({row['gpu_share']:g})" if 0 < row["gpu_share"] < 1 else "")
        print(f"{row['actor']:<14} {'' if row['node'] is None else row['node']:>4} {gpus or '-':<12} "
              f"{row['cpus']:>5g} {'' if row['memory_gib'] is None else row['memory_gib']:>9}")
    print(f"total: {plan['gpus']:g} GPUs on {plan['nodes']} node(s)")
    if plan["host"]:
        print(f"host memory, GB an actor (a {plan['node_memory_gb']:.1f} GB machine; learners at one sequence of "
              f"max_model_len a micro-batch = floor, at the token budget = budget):")
        print(f"{'role':<14} {'actors':>6} {'resident':>9} {'floor':>7} {'budget':>7}")
        for row in plan["host"]:
            print(f"{row['role']:<14} {row['num']:>6} {row['resident_gb']:>9.1f} {row['floor_gb']:>7.1f} "
                  f"{row['peak_gb']:>7.1f}")
        print(f"{'total':<14} {'':>6} {phase_totals(plan['host'], 'resident_gb'):>9.1f} "
              f"{phase_totals(plan['host'], 'floor_gb'):>7.1f} {phase_totals(plan['host'], 'peak_gb'):>7.1f}")
    for w in plan["warnings"]:
        print(f"warning: {w}")
    for e in plan["errors"]:
        print(f"error: {e}")

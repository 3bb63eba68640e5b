"""Where a run's numbers go: metrics.jsonl (one line per step), TensorBoard, Weights & Biases, the Ray dashboard's
gauges, and the progress bar; a sample of each step's episodes goes to traces.jsonl (learners/traces.py).

metrics.jsonl keeps the flat names the code writes (reward_mean, kl, train_s); the trackers show them grouped
(reward/mean, actor/kl, timing/train_s) by `grouped_name`, the one mapping docs/TRAINING.md lists.
"""
from __future__ import annotations

import json
import math
import re
import secrets
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import yaml

from actors.trajectory import RolloutSummary
from learners.config import LoggingConfig
from learners.dynamic_sampling import gather, kept_groups
from learners.learner_step import LearnerStep
from learners.traces import TraceLog, line_step
from rewards.registry import is_diagnostic
from tasks.extras import require

#: The trackers' group of each flat name of metrics.jsonl. Names that hold a '/' are grouped already
#: (reward/<component>, eval/<split>/<metric>, nci/*, spread/*, actor_restarts/*, startup/*, metric/*, and a recipe's
#: <recipe>/*).
GROUPS = {
    "actor": ("loss", "sft_loss", "sft_tokens", "kl", "entropy", "clip_fraction", "grad_norm", "lr",
              "optimizer_steps", "fidelity_max_abs_diff"),
    "rollout": ("response_length", "truncated_fraction", "tokens_per_s", "env_calls", "env_errors",
                "env_calls_per_episode", "env_idle_fraction", "groups_filtered",
                "groups_padded", "extra_generation_rounds"),
    "weights": ("weight_version", "batch_weight_version", "version_lag", "sync_retries", "sync_mb"),
    "progress": ("stage",),
}
RENAMED = {"reward_mean": "reward/mean", "reward_std": "reward/std", "accuracy": "reward/accuracy",
           # dynamic sampling: the same over the groups kept for training (the plain names: all groups sampled)
           "reward_mean_kept": "reward/mean_kept", "reward_std_kept": "reward/std_kept",
           "accuracy_kept": "reward/accuracy_kept"}
GROUP_OF = {key: group for group, keys in GROUPS.items() for key in keys}


def grouped_name(key: str) -> str:
    """A metrics.jsonl name as the trackers show it: durations (`*_s`) under timing/, the rest by GROUPS (other/
    for a name not listed there)."""
    if "/" in key:
        return key
    if key in RENAMED:
        return RENAMED[key]
    if key.endswith("_s") and key not in GROUP_OF:
        return f"timing/{key}"
    return f"{GROUP_OF.get(key, 'other')}/{key}"

BAR_KEYS = [("sft_loss", "loss"), ("reward_mean", "reward"), ("accuracy", "acc"), ("response_length", "len"), ("kl", "kl"),
            ("generate_s", "gen_s"), ("train_s", "train_s"), ("version_lag", "lag")]


class Laps:
    """A stopwatch of named phases: `lap(name)` records the seconds since the previous lap (or since creation);
    `total()` gives them as `startup/<name>_s` plus `startup/total_s`, the keys a run's first step reports."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = now - self._last
        self._last = now

    def total(self) -> dict[str, float]:
        return {**{f"startup/{k}_s": v for k, v in self.seconds.items()}, "startup/total_s": sum(self.seconds.values())}

    def __str__(self) -> str:
        return f"{sum(self.seconds.values()):.1f} s: " + ", ".join(f"{k} {v:.1f}" for k, v in self.seconds.items())


class MetricsLogger:
    def __init__(self, out: Path, cfg: LoggingConfig, resume_step: int | None = None):
        self.path = out / "metrics.jsonl"
        self.cfg = cfg
        if resume_step is not None and self.path.exists():
            # Steps after the checkpoint are trained again; keep the log one line per step.
            kept = [line for line in self.path.read_text().splitlines() if line_step(line) <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self.file = open(self.path, "a", buffering=1)
        self.traces = TraceLog(out, cfg, resume_step)
        self.tb = None
        self.gauges: dict = {}
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            # TensorBoard hides the events from purge_step on: the steps after the checkpoint, not its own
            self.tb = SummaryWriter(str(out / "tensorboard"),
                                    purge_step=None if resume_step is None else resume_step + 1)
        self.wandb = start_wandb(out, cfg, resumed=resume_step is not None) if cfg.wandb else None

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        scalars = {grouped_name(k): v for k, v in record.items()
                   if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}
        for k, v in scalars.items():
            if self.tb:
                self.tb.add_scalar(k, v, record["step"])
            self._gauge(k).set(v)
        if self.wandb:
            self.wandb.log(scalars, step=record["step"])

    def _gauge(self, key: str):
        """A Ray metric per scalar (medray_reward_mean for reward/mean, ...), so the dashboard's metrics view shows
        training next to the actors and resources."""
        if key not in self.gauges:
            from ray.util.metrics import Gauge
            name = "medray_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
            self.gauges[key] = Gauge(name, description=f"medray training metric {key}")
        return self.gauges[key]

    @contextmanager
    def progress(self, total: int, start: int):
        from tqdm import tqdm
        bar = tqdm(total=total, initial=start, desc="train", unit="step", disable=not self.cfg.progress_bar,
                   dynamic_ncols=True)

        class Bar:
            @staticmethod
            def update(record: dict) -> None:
                bar.set_description(record.get("stage_name", "train"), refresh=False)
                bar.set_postfix({short: f"{record[k]:.3g}" for k, short in BAR_KEYS if k in record}, refresh=False)
                bar.update(record["step"] - bar.n)  # by step: a restart from a checkpoint moves it back
        try:
            yield Bar
        finally:
            bar.close()

    def flush(self) -> None:
        """Everything logged so far on disk (before the run's files are copied elsewhere)."""
        self.file.flush()
        if self.tb:
            self.tb.flush()

    def close(self) -> None:
        self.file.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()


def start_wandb(out: Path, cfg: LoggingConfig, resumed: bool):
    """A W&B run with the run's config.yaml as its config; a resumed run continues the W&B run of its first start
    (its id is kept in output_dir/wandb/run_id)."""
    wandb = require("wandb", "wandb")
    id_file = out / "wandb" / "run_id"
    id_file.parent.mkdir(parents=True, exist_ok=True)
    if not (resumed and id_file.is_file()):
        id_file.write_text(secrets.token_hex(4))
    config = yaml.safe_load((out / "config.yaml").read_text()) if (out / "config.yaml").is_file() else None
    return wandb.init(project=cfg.wandb.project, name=cfg.wandb.name or out.resolve().name, mode=cfg.wandb.mode,
                      dir=str(out), id=id_file.read_text().strip(), resume="allow", config=config,
                      settings=wandb.Settings(silent=not cfg.verbose))


def hook_stats(summaries: list[RolloutSummary]) -> dict[str, float]:
    """The numbers the recipe's rollout hooks returned (actors/hooks.py), summed over the workers' summaries."""
    total: dict[str, float] = {}
    for summary in summaries:
        for k, v in summary.hook_stats.items():
            total[k] = total.get(k, 0) + v
    return total


def reward_metrics(scores: list[dict], suffix: str = "") -> dict:
    """The reward columns over every sample of `scores` (reward actors' score dicts, concatenated): reward_mean,
    reward_std, reward/<component> (a diagnostic component under its own name), reward_errors/<component>,
    nci/<component> and spread/<component> (means over the dicts: one value per reward call), and accuracy when a
    component is named so; each key with `suffix` appended."""
    totals = np.array([x for s in scores for x in s["total"]])
    components: dict[str, list[float]] = {}
    errors: dict[str, int] = {}
    for s in scores:
        for k, v in s["components"].items():
            components.setdefault(k, []).extend(v)
        for k, v in s.get("errors", {}).items():
            errors[k] = errors.get(k, 0) + v
    per_group: dict[str, list[float]] = {}  # nci/<component> and spread/<component>, one value per reward shard
    for s in scores:
        for kind in ("nci", "spread"):
            for k, v in s.get(kind, {}).items():
                per_group.setdefault(f"{kind}/{k}", []).append(v)
    record = {
        "reward_mean": float(totals.mean()), "reward_std": float(totals.std()),
        **{f"reward/{k}": float(np.mean(v)) for k, v in components.items() if not is_diagnostic(k)},
        **{k: float(np.nanmean(v)) for k, v in components.items() if is_diagnostic(k) and not np.isnan(v).all()},
        **{f"reward_errors/{k}": v for k, v in errors.items()},
        **{k: float(np.mean(v)) for k, v in per_group.items()},
    }
    if "accuracy" in components:
        record["accuracy"] = record["reward/accuracy"]
    return {k + suffix: v for k, v in record.items()}


def sample_totals(scores: list[dict]) -> list[float]:
    """Each sample's total reward, in trajectory order, from reward actors' score dicts (one per trajectory share)."""
    return [x for s in scores for x in s["total"]]


def kept_scores(rounds: list[list[dict]], picks: list[tuple[int, int]], group_size: int) -> list[dict]:
    """One score dict of the samples dynamic sampling kept for training (`picks`: learners.dynamic_sampling.kept_groups)
    out of each generation round's score dicts: their totals and components. Errors, NCI and spread are per reward
    call, not per sample, so the kept groups have none."""
    def column(values) -> list[float]:  # per sample, rounds laid out as the trajectories are
        return gather([[x for s in scores for x in values(s)] for scores in rounds], picks, group_size)

    names = rounds[0][0]["components"]  # one reward spec for the whole step
    return [{"total": column(lambda s: s["total"]),
             "components": {k: column(lambda s, k=k: s["components"][k]) for k in names}}]


def kept_metrics(rounds: list[list[dict]], group_size: int, num_groups: int) -> dict:
    """`reward_metrics` of the groups dynamic sampling keeps for training (`kept_groups`), each key suffixed `_kept`:
    reward_mean_kept, reward_std_kept, reward/<component>_kept, accuracy_kept. `rounds`: each generation round's
    score dicts, in round order."""
    picks, _ = kept_groups([sample_totals(scores) for scores in rounds], group_size, num_groups)
    return reward_metrics(kept_scores(rounds, picks, group_size), suffix="_kept")


def step_metrics(step: int, scores: list[dict], summaries: list[RolloutSummary], train: LearnerStep, sync: dict,
                 version: int) -> dict:
    """One line of metrics.jsonl: reward and its components (`reward_metrics` over `scores`: with dynamic sampling
    every generation round's, i.e. all the groups sampled in the step, not only those kept for training), lengths,
    learner statistics and timings."""
    lengths = [n for s in summaries for n in s.lengths]
    batch_versions = [s.version for s in summaries]
    tokens = sum(lengths)
    mask_sum = max(train.mask_sum, 1.0)
    return {
        "step": step,
        **reward_metrics(scores),
        "response_length": float(np.mean(lengths)),
        "truncated_fraction": float(np.mean([r == "length" for s in summaries for r in s.finish_reasons])),
        "env_calls": sum(s.env_calls for s in summaries), "env_errors": sum(s.env_errors for s in summaries),
        "env_calls_per_episode": sum(s.env_calls for s in summaries) / max(len(lengths), 1),
        "env_idle_fraction": sum(s.idle_s for s in summaries) / max(sum(s.seconds for s in summaries), 1e-9),
        **hook_stats(summaries),
        "kl": train.kl_sum / mask_sum, "entropy": train.entropy_sum / mask_sum,
        "clip_fraction": train.clip_sum / mask_sum, "grad_norm": train.grad_norm, "lr": train.lr,
        "loss": train.loss, "optimizer_steps": train.optimizer_steps,
        "generate_s": max(s.seconds for s in summaries), "reward_s": max(s["seconds"] for s in scores), "train_s": train.seconds,
        **sync,
        "tokens_per_s": tokens / max(max(s.seconds for s in summaries), 1e-9),
        "batch_weight_version": min(batch_versions), "weight_version": version,
        "version_lag": version - 1 - min(batch_versions),
        **train.reports, **peak_memory("rollout", [s.peak_memory_gb for s in summaries]),
        **peak_memory("reward", [s["peak_memory_gb"] for s in scores]),
    }


def peak_memory(role: str, peaks: list[dict[str, float]]) -> dict[str, float]:
    """`memory/<role>_peak_gb` (resident) and `memory/<role>_gpu_peak_gb`: the largest of one role's actors' peaks
    (`cluster.devices.peak_memory_gb`) in GB."""
    out = {}
    for kind, suffix in (("rss", ""), ("gpu", "_gpu")):
        values = [p[kind] for p in peaks if kind in p]
        if values:
            out[f"memory/{role}{suffix}_peak_gb"] = max(values)
    return out

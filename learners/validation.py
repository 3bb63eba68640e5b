"""Held-out evaluation inside a run (the `eval` section), on the run's own rollout workers between steps, and the
run's closing report: every evaluation of the run (the base weights first), and a plot of the curves.

Each evaluation writes output_dir/eval/step_<N>/<split>/{eval.json, eval.md, samples.jsonl}; the closing report writes
output_dir/eval.md, eval.json and curves.png.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from learners.config import RunConfig
from learners.data import load_tasks
from learners.evaluate import (eval_grammar, greedy_sampling, open_questions, run_episodes, score, split_dir_name,
                               text_only_view, write_report, write_samples)
from learners.judge_eval import judge_open_answers

#: The metrics of one split that go into metrics.jsonl as eval/<split>/<name> (intervals as _low/_high).
LOGGED = ("accuracy", "closed_accuracy", "judge_accuracy", "judge_parse_failures", "format_rate", "gold_retrieved",
          "env_calls_per_sample", "response_length")

log = logging.getLogger("medray.eval")


class Validator:
    """Evaluates the weights the rollout workers hold on every split of `cfg.eval`."""

    def __init__(self, cfg: RunConfig, out: Path, policy_path: str):
        self.cfg, self.out = cfg, out
        self.splits = {split: text_only_view(load_tasks(split)[:cfg.eval.limit], policy_path)
                       for split in cfg.eval.data}

    def due(self, step: int) -> bool:
        """Whether step `step` (just finished) ends with an evaluation."""
        every = self.cfg.eval.every
        return bool(every and step % every == 0) or (self.cfg.eval.at_end and step == self.cfg.total_steps)

    def run(self, workers: list, step: int, grammar: dict, judge=None) -> dict:
        """Greedy episodes of every split under the workers' current weights; returns eval/<split>/<metric>. With
        `eval.judge`, `judge` (the run's JudgeActor) grades the open answers."""
        record = {}
        for split, tasks in self.splits.items():
            trajectories, summaries = run_episodes(workers, tasks, greedy_sampling(self.cfg), self.cfg.seed,
                                                   self.cfg.eval.batch_size, eval_grammar(self.cfg, grammar),
                                                   desc=f"eval {split}")
            metrics = score(trajectories, summaries)
            if self.cfg.eval.judge:
                metrics.update(judge_open_answers(open_questions(trajectories), judge))
            where = self.out / "eval" / f"step_{step}" / split_dir_name(split)
            write_report(where, metrics, f"step {step} on {split}", {"step": step, "data": split})
            write_samples(where / "samples.jsonl", trajectories)
            shown = {k: metrics[k]["mean"] for k in ("accuracy", "format_rate") if isinstance(metrics.get(k), dict)}
            log.info("eval at step %d on %s: %s (n=%d)", step, split,
                     ", ".join(f"{k} {v:.1%}" for k, v in shown.items()), metrics["n"])
            for name in LOGGED:
                value = metrics.get(name)
                if isinstance(value, dict):
                    record.update({f"eval/{split}/{name}": value["mean"], f"eval/{split}/{name}_low": value["low"],
                                   f"eval/{split}/{name}_high": value["high"]})
                elif value is not None:
                    record[f"eval/{split}/{name}"] = value
        return record


def evaluated_steps(out: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step_")) for p in (out / "eval").glob("step_*") if p.is_dir())


def weights_label(cfg: RunConfig, step: int) -> str:
    """'base' at step 0, else 'after <stage>' or '<stage> step k' for an evaluation inside a stage."""
    if step == 0:
        return "base"
    end = 0
    for stage in cfg.stage_plan():
        end += stage.steps
        if step <= end:
            return f"after {stage.name}" if step == end else f"{stage.name} step {step - end + stage.steps}"
    return f"step {step}"


def closing_report(cfg: RunConfig, out: Path) -> str | None:
    """Every evaluation of the run, split by split (the base weights first when the run evaluated at its start);
    written to eval.md and eval.json in `out` and returned as Markdown (None before any evaluation)."""
    steps = evaluated_steps(out)
    if not steps:
        return None
    rows = ["| split | weights | accuracy [95% interval] | answer format | retrievals per question | gold document "
            "retrieved | n |", "|---|---|---|---|---|---|---|"]
    table = {}
    for split in cfg.eval.data:
        for step in steps:
            path = out / "eval" / f"step_{step}" / split_dir_name(split) / "eval.json"
            if not path.is_file():
                continue
            m = json.loads(path.read_text())
            table.setdefault(split, {})[step] = m
            acc = m.get("accuracy")
            acc_text = f"{acc['mean']:.1%} [{acc['low']:.1%}, {acc['high']:.1%}]" if acc else "-"
            gold = f"{m['gold_retrieved']['mean']:.1%}" if "gold_retrieved" in m else "-"
            rows.append(f"| {split} | {weights_label(cfg, step)} (step {step}) | {acc_text} | "
                        f"{m['format_rate']['mean']:.1%} | {m['env_calls_per_sample']:.2f} | {gold} | {m['n']} |")
    text = f"## Held-out evaluation of {cfg.output_dir}\n\n" + "\n".join(rows) + "\n"
    (out / "eval.md").write_text(text)
    (out / "eval.json").write_text(json.dumps({"steps": steps, "splits": table}, indent=1))
    return text


def plot_curves(out: Path, cfg: RunConfig) -> Path | None:
    """curves.png: SFT loss, GRPO reward and training accuracy per step, and the held-out accuracy of every
    evaluation. matplotlib is imported here: only the closing report needs it."""
    path = out / "metrics.jsonl"
    if not path.is_file():
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    fig, (loss_ax, reward_ax) = plt.subplots(1, 2, figsize=(11, 4))
    sft = [(r["step"], r["sft_loss"]) for r in records if "sft_loss" in r]
    if sft:
        loss_ax.plot(*zip(*sft), marker=".", color="tab:purple")
    loss_ax.set(title="SFT cold start", xlabel="step", ylabel="cross-entropy per token")
    grpo = [r for r in records if "reward_mean" in r]
    if grpo:
        reward_ax.plot([r["step"] for r in grpo], [r["reward_mean"] for r in grpo], label="reward (mean)")
        if any("accuracy" in r for r in grpo):
            reward_ax.plot([r["step"] for r in grpo], [r.get("accuracy") for r in grpo], label="accuracy (rollouts)")
    for split in (cfg.eval.data if cfg.eval else []):
        key = f"eval/{split}/accuracy"
        points = [(r["step"], r[key], r[key + "_low"], r[key + "_high"]) for r in records if key in r]
        if points:
            steps, acc, low, high = zip(*points)
            errors = [[a - lo for a, lo in zip(acc, low)], [h - a for a, h in zip(acc, high)]]
            reward_ax.errorbar(steps, acc, yerr=errors, fmt="o", capsize=3, label=f"held-out accuracy ({split})")
    top = max([1.0] + [r["reward_mean"] for r in grpo])
    reward_ax.set(title="GRPO reward and held-out accuracy", xlabel="step", ylim=(0, 1.05 * top))
    reward_ax.legend(fontsize=8)
    fig.tight_layout()
    target = out / "curves.png"
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target

"""Held-out evaluation inside a run (the `eval` section), on the run's own rollout workers between steps, and the
run's closing report: every evaluation of the run (the base weights first), and a plot of the curves.

Each evaluation writes output_dir/eval/step_<N>/<split>/{eval.json, eval.md, samples.jsonl}; the closing report writes
output_dir/eval.md, eval.json and curves.png.
"""
from __future__ import annotations

import json
import logging
from itertools import accumulate
from pathlib import Path

from learners.config import RunConfig
from learners.data import load_tasks
from learners.evaluate import (eval_grammar, greedy_sampling, open_questions, run_episodes, score, split_dir_name,
                               text_only_view, write_report, write_samples)
from learners.judge_eval import judge_open_answers

#: The metrics of one split that go into metrics.jsonl as eval/<split>/<name> (intervals as _low/_high).
LOGGED = ("accuracy", "top3_accuracy", "closed_accuracy", "judge_accuracy", "judge_parse_failures", "format_rate",
          "gold_retrieved", "env_calls_per_sample", "response_length", "gold_linked", "gold_linked_first",
          "accuracy_first_linked", "accuracy_first_unlinked", "gold_ranked_first", "accuracy_gold_ranked_first",
          "follows_ranking")

log = logging.getLogger("medray.eval")


class Validator:
    """Evaluates the weights the rollout workers hold on every split of `cfg.eval`."""

    def __init__(self, cfg: RunConfig, out: Path, policy_path: str):
        self.cfg, self.out = cfg, out
        self.splits = {split: text_only_view(load_tasks(split)[:cfg.eval.limit], policy_path)
                       for split in cfg.eval.data}

    def due(self, step: int) -> bool:
        """Whether step `step` (just finished) ends with an evaluation: every eval.every steps, at the end of every
        stage but the last with eval.at_stage_end, and at the run's end with eval.at_end."""
        every, cfg = self.cfg.eval.every, self.cfg
        stage_ends = set(accumulate(stage.steps for stage in cfg.stage_plan())) - {cfg.total_steps}
        return bool(every and step % every == 0) or (cfg.eval.at_end and step == cfg.total_steps) or \
            (cfg.eval.at_stage_end and step in stage_ends)

    def run(self, workers: list, step: int, grammar: dict, judge=None, version: int = 0, restore=None) -> dict:
        """Greedy episodes of every split under the workers' current weights (those of `version`); returns
        eval/<split>/<metric>. With `eval.judge`, `judge` (the run's JudgeActor) grades the open answers. A worker
        lost meanwhile is given the weights again by `restore` and its share generated again (`run_episodes`)."""
        record = {}
        for split, tasks in self.splits.items():
            trajectories, summaries = run_episodes(workers, tasks, greedy_sampling(self.cfg), self.cfg.seed,
                                                   self.cfg.eval.batch_size, eval_grammar(self.cfg, grammar),
                                                   f"eval {split}", version, restore)
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


def load_evaluations(cfg: RunConfig, out: Path, steps: list[int]) -> dict[str, dict[int, dict]]:
    """{split: {step: its eval.json}} of every evaluation under out/eval/step_<N>/, splits in the config's order."""
    table: dict[str, dict[int, dict]] = {}
    for split in cfg.eval.data:
        for step in steps:
            path = out / "eval" / f"step_{step}" / split_dir_name(split) / "eval.json"
            if path.is_file():
                table.setdefault(split, {})[step] = json.loads(path.read_text())
    return table


def percent(value: dict | None, interval: bool = True, n: bool = False) -> str:
    """A proportion ({mean, low, high, n}) as '80.0% [72.9%, 85.6%]', '80.0%' or '80.0% (n=150)'; '-' when absent."""
    if not value:
        return "-"
    return f"{value['mean']:.1%}" + (f" [{value['low']:.1%}, {value['high']:.1%}]" if interval else "") + \
        (f" (n={value['n']})" if n else "")


def accuracy_table(cfg: RunConfig, table: dict[str, dict[int, dict]]) -> list[str]:
    """The main table: accuracy with its interval, format, retrievals and gold document, one row per evaluation.
    Ranked real-case diagnoses (phenopackets:...#open_test) add a top-3 column beside accuracy, their top-1."""
    top3 = any("top3_accuracy" in m for evaluations in table.values() for m in evaluations.values())
    rows = ["| split | weights | accuracy [95% interval] | " + ("top-3 [95% interval] | " if top3 else "") +
            "answer format | retrievals per question | gold document retrieved | n |",
            "|---|---|---|" + ("---|" if top3 else "") + "---|---|---|---|"]
    for split, evaluations in table.items():
        for step, m in evaluations.items():
            gold = percent(m.get("gold_retrieved"), interval=False)
            rows.append(f"| {split} | {weights_label(cfg, step)} (step {step}) | {percent(m.get('accuracy'))} | " +
                        (f"{percent(m.get('top3_accuracy'))} | " if top3 else "") +
                        f"{m['format_rate']['mean']:.1%} | {m['env_calls_per_sample']:.2f} | {gold} | {m['n']} |")
    return rows


def behaviour_table(cfg: RunConfig, table: dict[str, dict[int, dict]]) -> list[str]:
    """How a retrieval agent's searches linked the gold option (learners/evaluate.py:option_links), one row per
    evaluation that has it; no rows when none does."""
    ranking = any("follows_ranking" in m for evaluations in table.values() for m in evaluations.values())
    rows = [f"| {split} | {weights_label(cfg, step)} (step {step}) | {percent(m['gold_linked'], interval=False)} | "
            f"{percent(m['gold_linked_first'], interval=False)} | "
            f"{percent(m.get('accuracy_first_linked'), interval=False, n=True)} | "
            f"{percent(m.get('accuracy_first_unlinked'), interval=False, n=True)} |" +
            (f" {percent(m.get('follows_ranking'), interval=False, n=True)} |" if ranking else "")
            for split, evaluations in table.items() for step, m in evaluations.items() if "gold_linked" in m]
    return ["| split | weights | gold option linked (any search) | gold option linked (first search) | accuracy, "
            "first search linked it | accuracy, first search did not |" +
            (" answers the ranking's first, where shown |" if ranking else ""),
            "|---|---|---|---|---|---|" + ("---|" if ranking else ""), *rows] if rows else []


def stage_gain(cfg: RunConfig, evaluations: dict[int, dict]) -> dict | None:
    """What the run's last stage added to one split's held-out accuracy: the final evaluation's (step total_steps)
    minus that of the evaluation where the stage began (the previous stage's end, or the base), in points, with both
    accuracies and their Wilson intervals; None unless both evaluations have an accuracy."""
    last = cfg.stage_plan()[-1]
    start, end = cfg.total_steps - last.steps, cfg.total_steps
    before, after = (evaluations.get(step, {}).get("accuracy") for step in (start, end))
    if not (before and after):
        return None
    return {"stage": last.name, "points": 100 * (after["mean"] - before["mean"]),
            "before": {**before, "step": start, "weights": weights_label(cfg, start)},
            "after": {**after, "step": end, "weights": weights_label(cfg, end)}}


def gain_text(split: str, gain: dict, labels: bool = True) -> str:
    """'grpo added +1.3 points on hpo:mcq_test: 78.7% [71.4%, 84.5%] after cold_start (step 10) -> 80.0% [...] after
    grpo (step 18)' (`labels` False: without the weights labels)."""
    def side(m: dict) -> str:
        return percent(m) + (f" {m['weights']} (step {m['step']})" if labels else "")
    return f"{gain['stage']} added {gain['points']:+.1f} points on {split}: " \
        f"{side(gain['before'])} -> {side(gain['after'])}"


def closing_report(cfg: RunConfig, out: Path) -> str | None:
    """Every evaluation of the run, split by split (the base weights first when the run evaluated at its start): the
    accuracy table, the retrieval behaviour table when the agent's searches linked options, and what the last stage
    added (`stage_gain`); written to eval.md and eval.json (`last_stage_gain`: {split: gain}) in `out` and returned as
    Markdown (None before any evaluation)."""
    steps = evaluated_steps(out)
    if not steps:
        return None
    table = load_evaluations(cfg, out, steps)
    gains = {split: g for split, evaluations in table.items() if (g := stage_gain(cfg, evaluations))}
    behaviour = behaviour_table(cfg, table)
    text = f"## Held-out evaluation of {cfg.output_dir}\n\n" + "\n".join(accuracy_table(cfg, table)) + "\n" + \
        ("\n### Retrieval behaviour\n\n" + "\n".join(behaviour) + "\n" if behaviour else "") + \
        "".join(f"\n{gain_text(split, gain)}\n" for split, gain in gains.items())
    (out / "eval.md").write_text(text)
    (out / "eval.json").write_text(json.dumps({"steps": steps, "splits": table, "last_stage_gain": gains}, indent=1))
    return text


def gain_summary(out: Path) -> str:
    """The closing eval.json's `last_stage_gain` in one clause per split, for the run's `done:` line ('' without)."""
    path = out / "eval.json"
    gains = json.loads(path.read_text()).get("last_stage_gain", {}) if path.is_file() else {}
    return "".join(f"{gain_text(split, gain, labels=False)}; " for split, gain in gains.items())


def split_label(split: str) -> str:
    """A split as a plot names it: a path inside it shortened to its file name
    (phenopackets:/data/store.zip#mcq_test -> phenopackets:store.zip#mcq_test)."""
    scheme, colon, rest = split.rpartition(":")
    path, hash_sign, fragment = rest.partition("#")
    return f"{scheme}{colon}{Path(path).name}{hash_sign}{fragment}"


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
        # reward_mean and accuracy are over every group sampled (dynamic sampling's kept ones are the *_kept keys)
        reward_ax.plot([r["step"] for r in grpo], [r["reward_mean"] for r in grpo], label="reward (mean, all sampled)")
        if any("accuracy" in r for r in grpo):
            reward_ax.plot([r["step"] for r in grpo], [r.get("accuracy") for r in grpo],
                           label="accuracy (rollouts, all sampled)")
    for split in (cfg.eval.data if cfg.eval else []):
        key = f"eval/{split}/accuracy"
        points = [(r["step"], r[key], r[key + "_low"], r[key + "_high"]) for r in records if key in r]
        if points:
            steps, acc, low, high = zip(*points)
            errors = [[a - lo for a, lo in zip(acc, low)], [h - a for a, h in zip(acc, high)]]
            reward_ax.errorbar(steps, acc, yerr=errors, fmt="o", capsize=3,
                               label=f"held-out accuracy ({split_label(split)})")
    top = max([1.0] + [r["reward_mean"] for r in grpo])
    reward_ax.set(title="GRPO reward and held-out accuracy", xlabel="step", ylim=(0, 1.05 * top))
    reward_ax.legend(fontsize=8)
    fig.tight_layout()
    target = out / "curves.png"
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target

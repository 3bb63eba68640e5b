"""Proof that the recipes learn what the papers report, on this machine.

    python benchmarks/bench_learning.py --suite quickstart [--seeds 0 1] [key=value ...]
    python benchmarks/bench_learning.py --suite retrieval [--sft-steps 60 --rl-steps 40 --eval-limit 200] [key=value ...]
    python benchmarks/bench_learning.py --suite armed [--sft-steps 60 --rl-steps 40]

key=value overrides (e.g. a larger tiny model: model.tiny.hidden_size=256) apply to every arm, its demonstrations and
its evaluation; --name keeps each setting's runs apart (outputs/bench_learning/<name>/).

quickstart: configs/quickstart.yaml as shipped (SmolLM2-135M-Instruct: cold start on expert demonstrations, then GRPO
with retrieval), once per seed; the held-out accuracy of the base model, after the cold start and after GRPO (the
run's own evaluations, hpo:mcq_test), with the wall-clock of the whole run including start-up.
retrieval: the HPO diagnosis task, evaluated on held-out diseases (hpo:mcq_test: no test disease occurs in training,
so only retrieval can answer), tiny Qwen2. Two cold starts of S SFT steps each, and R GRPO steps (at --rl-lr) from them:
  sft_only            SFT on scripted-expert retrieval demonstrations (learners/expert.py), S steps
  sft_direct          SFT on think-then-answer demonstrations (no retrieval), S steps
  grpo_no_retrieval   sft_direct's weights + R GRPO steps, single turn (format + accuracy)
  grpo_retrieval      sft_only's weights + R GRPO steps with the retriever (format + accuracy)
  grpo_retrieval_rwr  the same + Med-RwR's query-semantic (MedCAT) and confidence-gain rewards
The GRPO arms take R optimizer steps more than the SFT arms (S + R against S).
Settings measured (README *Measured*): answers as text or letters; `retrieval.show=titles retrieval.link_options=true`
shows each hit's title only, marked "(option X)" when it is an option, so reading is one letter and what the policy
must learn is a query that retrieves the right disease; and that with a tiny model pre-trained to copy
(`model.tiny.copy_pretrain_steps=5000`), the only setting where retrieval won.
armed: ARMed's adaptive vs static semantic reward on the open-ended HPO task (text): the NCI of the semantic
component over R GRPO steps (goal: adaptive stays >= 0.25 where static falls below 0.1), both from one SFT cold start
of S steps on direct demonstrations (ARMed trains a model that already answers; --sft-steps 0: from random weights).
Writes benchmarks/results/learning_<suite>.json and a plot (learning_retrieval_<name>.png: the setting's arms;
learning_armed[_<name>].png), and prints a table.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import report  # noqa: E402

PYTHON = sys.executable
RUNS = ROOT / "outputs" / "bench_learning"  # /<--name>/: one folder per setting
TINY = "configs/tiny.yaml"  # the retrieval and armed suites' tiny random model
SINGLE_TURN = ["rollout.grammar.action_tag=null", "retrieval=null"]
# A query lists a case's phenotypes (~40-60 tokens): room for it in one generation turn, for training and evaluation.
LENGTHS = ["rollout.max_new_tokens=96", "rollout.grammar.max_response_tokens=320"]
# Adam's first steps at full lr knock a fresh model off course: SFT loss 4.3 vs 1.9 after 40 steps without/with these
# 10 warm-up steps (tiny Qwen2, retrieval demonstrations, lr 5e-3).
WARMUP = ["learner.warmup_steps=10"]
FORMAT_ACCURACY = "rewards.components=[{name: tag_format, args: {tags: [answer]}}, {name: accuracy, weight: 2.0}]"
RWR = ("rewards.components=[{name: tag_format, args: {tags: [answer]}}, {name: accuracy, weight: 2.0}, "
       "{name: query_semantic_text, weight: 0.4}, {name: confidence_gain, weight: 1.0}]")


def demonstrations(runs: Path, kind: str, args, data: str = "hpo:mcq_train") -> Path:
    """Expert demonstrations for a training split (by default the multiple-choice one): with retrieval (the
    quickstart's grammar) or direct."""
    from learners.config import load_config
    from learners.expert import write_demonstrations
    split = "" if data == "hpo:mcq_train" else f"{data.split(':')[-1]}_"
    out = runs / f"demos_{kind}_{split}{args.answer_with}.jsonl"
    if not out.exists():
        cfg = load_config(ROOT / TINY, args.overrides + (SINGLE_TURN if kind == "direct" else []))
        print(write_demonstrations(cfg, data, out, args.demo_limit, answer_with=args.answer_with))
    return out


def train(out: Path, overrides: list[str]) -> tuple[Path, float, list[dict]]:
    """Train (unless a finished run is there); its checkpoint, its training seconds (the logged steps', so a run
    reused later keeps its time) and its metrics."""
    if not (out / "checkpoints" / "latest").exists():
        subprocess.run([PYTHON, "learners/run.py", "--config", TINY, f"output_dir={out}",
                        "logging.progress_bar=false", "checkpoint.every=1000", *LENGTHS, *WARMUP, *overrides], cwd=ROOT,
                       check=True)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out / "checkpoints" / "latest", sum(m.get("step_s", 0.0) for m in metrics), metrics


def evaluate(checkpoint: Path, overrides: list[str], limit: int) -> dict:
    out = checkpoint.parent.parent / "eval_test"
    if not (out / "eval.json").exists():
        subprocess.run([PYTHON, "-m", "learners.evaluate", "--config", TINY, "--checkpoint",
                        str(checkpoint), "--data", "hpo:mcq_test", "--limit", str(limit), "--out", str(out),
                        *LENGTHS, *overrides], cwd=ROOT, check=True)
    return json.loads((out / "eval.json").read_text())


def cold_start(steps: int, demos: Path) -> list[str]:
    """Overrides for a run that is one SFT stage of `steps` steps on `demos`."""
    return [f"total_steps={steps}",
            "stages=[{name: cold_start, kind: sft, steps: %d, sft: {data: %s, batch_size: 32}}]" % (steps, demos)]


def quickstart_suite(args) -> list[dict]:
    """The shipped quickstart once per seed: one row per evaluation of the run (base, after the cold start, after
    GRPO), read from the run's own eval.json; the run's wall-clock includes Ray and actor start-up."""
    rows = []
    for seed in args.seeds:
        out = RUNS / args.name / f"quickstart_seed{seed}"
        wall = None
        if not (out / "eval.json").exists():
            start = time.perf_counter()
            subprocess.run([PYTHON, "learners/run.py", "--config", "configs/quickstart.yaml", f"output_dir={out}",
                            f"seed={seed}", "logging.progress_bar=false", *args.overrides], cwd=ROOT, check=True)
            wall = time.perf_counter() - start
        from learners.config import load_config
        from learners.validation import weights_label
        cfg = load_config(out / "config.yaml")
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        timing = {"train_minutes": round(sum(m.get("step_s", 0.0) for m in metrics) / 60, 1),
                  "eval_minutes": round(sum(m.get("eval_s", 0.0) for m in metrics) / 60, 1),
                  "wall_minutes": round(wall / 60, 1) if wall else None}
        for split, by_step in json.loads((out / "eval.json").read_text())["splits"].items():
            for step, m in sorted(by_step.items(), key=lambda item: int(item[0])):
                acc = m["accuracy"]
                rows.append({"seed": seed, "split": split, "weights": weights_label(cfg, int(step)), "step": int(step),
                             "accuracy": round(acc["mean"], 4), "ci95": f"[{acc['low']:.3f}, {acc['high']:.3f}]",
                             "n": acc["n"], "format_rate": round(m["format_rate"]["mean"], 3),
                             "retrievals_per_question": round(m["env_calls_per_sample"], 2),
                             "gold_retrieved": round(m["gold_retrieved"]["mean"], 3) if "gold_retrieved" in m else None,
                             **timing})
    return rows


def retrieval_suite(args) -> list[dict]:
    s, r, runs = args.sft_steps, args.rl_steps, RUNS / args.name
    retrieval_demos, direct_demos = demonstrations(runs, "retrieval", args), demonstrations(runs, "direct", args)
    # GRPO continues from a cold start's checkpoint with a much lower lr: at the SFT lr (3e-3) 20 steps wiped out
    # what SFT taught (greedy outputs degenerated to repeated tokens).
    rl = [f"total_steps={r}", f"learner.lr={args.rl_lr}"]
    arms = {
        "sft_only": (cold_start(s, retrieval_demos), [], None),
        "sft_direct": ([*SINGLE_TURN, *cold_start(s, direct_demos)], SINGLE_TURN, None),
        "grpo_no_retrieval": ([*rl, *SINGLE_TURN, FORMAT_ACCURACY], SINGLE_TURN, "sft_direct"),
        "grpo_retrieval": ([*rl, FORMAT_ACCURACY], [], "sft_only"),
        "grpo_retrieval_rwr": ([*rl, RWR, "recipe=med_rwr"], [], "sft_only"),
    }
    rows = []
    for name in args.arms or arms:
        train_overrides, eval_overrides, start_from = arms[name]
        if start_from:  # the cold start's final weights (trained first if need be)
            cold, *_ = train(runs / start_from, [f"seed={args.seed}", *args.overrides, *arms[start_from][0]])
            train_overrides = [f"model.path={cold.resolve()}", *train_overrides]
        checkpoint, seconds, metrics = train(runs / name, [f"seed={args.seed}", *args.overrides, *train_overrides])
        result = evaluate(checkpoint, [*args.overrides, *eval_overrides], args.eval_limit)
        acc = result["accuracy"]
        rl = [m for m in metrics if "reward_mean" in m]
        rows.append({"arm": name, "test_accuracy": round(acc["mean"], 4),
                     "ci95": f"[{acc['low']:.3f}, {acc['high']:.3f}]", "n": acc["n"],
                     "format_rate": round(result["format_rate"]["mean"], 3),
                     "env_calls_per_sample": round(result["env_calls_per_sample"], 2),
                     "train_reward_last5": round(sum(m["reward_mean"] for m in rl[-5:]) / max(1, len(rl[-5:])), 3)
                     if rl else None, "train_minutes": round(seconds / 60, 1),
                     "steps": f"{s} SFT + {r} GRPO" if start_from else f"{s} SFT"})
    return rows


def armed_suite(args) -> list[dict]:
    runs, task = RUNS / args.name, ["data.train=hpo:open_train", *SINGLE_TURN]
    base = [*task, f"total_steps={args.rl_steps}", "rollout.stop=[</answer>]", "rollout.max_new_tokens=32",
            "rollout.temperature=0.7"]
    if args.sft_steps:  # ARMed starts RL from a model that already answers: both arms from one SFT cold start
        demos = demonstrations(runs, "direct", args, data="hpo:open_train")
        cold, *_ = train(runs / "armed_cold_start", [f"seed={args.seed}", *args.overrides, *task,
                                                      *cold_start(args.sft_steps, demos)])
        base += [f"model.path={cold.resolve()}", f"learner.lr={args.rl_lr}"]
    rows, curves = [], {}
    for adaptive in (True, False):
        name = f"armed_{'adaptive' if adaptive else 'static'}"
        rewards = ("rewards.components=[{name: armed_textual, weight: 0.4}, {name: armed_semantic, weight: 0.4, "
                   "args: {adaptive: %s}}, {name: tag_format, weight: 0.2, args: {tags: [answer]}}]"
                   % str(adaptive).lower())
        _, seconds, metrics = train(runs / name, [f"seed={args.seed}", *args.overrides, *base, rewards])
        nci = [m.get("nci/armed_semantic", 0.0) for m in metrics]
        curves[name] = nci
        tail = nci[len(nci) // 2:]
        rows.append({"arm": name, "nci_semantic_first5": round(sum(nci[:5]) / 5, 3),
                     "nci_semantic_second_half": round(sum(tail) / len(tail), 3),
                     "nci_semantic_min": round(min(nci), 3), "reward_last5": round(
                         sum(m["reward_mean"] for m in metrics[-5:]) / 5, 3), "train_minutes": round(seconds / 60, 1)})
    plot(rows, "armed", curves, setting=None if args.name == "default" else args.name)
    return rows


def plot(rows: list[dict], suite: str, curves: dict | None = None, setting: str | None = None) -> None:
    """learning_armed[_<setting>].png: NCI curves; learning_retrieval_<setting>.png: every arm of one setting run so
    far."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    if curves:
        for name, values in curves.items():
            ax.plot(range(1, len(values) + 1), values, label=name)
        ax.set_xlabel("step"), ax.set_ylabel("NCI of the semantic reward"), ax.axhline(0.25, ls=":", c="gray")
        ax.axhline(0.1, ls="--", c="gray"), ax.legend()
    else:
        ax.bar([r["arm"] for r in rows], [r["test_accuracy"] for r in rows])
        ax.axhline(0.25, ls=":", c="gray", label="chance (4 options)")
        ax.set_ylabel("accuracy on held-out diseases"), ax.legend()
        plt.setp(ax.get_xticklabels(), rotation=15)
    fig.tight_layout()
    path = ROOT / "benchmarks" / "results" / f"learning_{suite}{f'_{setting}' if setting else ''}.png"
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=["quickstart", "retrieval", "armed"], required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="quickstart: one run per seed")
    parser.add_argument("--arms", nargs="*", help="retrieval: a subset of the arms")
    parser.add_argument("--sft-steps", type=int, default=60, help="cold-start SFT steps (armed: 0 = RL from random weights)")
    parser.add_argument("--rl-steps", type=int, default=40)
    parser.add_argument("--rl-lr", type=float, default=3e-4, help="the GRPO arms' learning rate (armed: after a cold start)")
    parser.add_argument("--eval-limit", type=int, default=200)
    parser.add_argument("--demo-limit", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--answer-with", choices=["letter", "text"], default="text",
                        help="how the expert answers: the option letter, or the option text (copied from the hit)")
    parser.add_argument("--name", default="default", help="runs go to outputs/bench_learning/<name>/")
    parser.add_argument("overrides", nargs="*", help="key=value for every arm (e.g. model.tiny.hidden_size=256)")
    args = parser.parse_args()
    rows = {"quickstart": quickstart_suite, "retrieval": retrieval_suite, "armed": armed_suite}[args.suite](args)
    rows = [{**r, "setting": args.name, "command": " ".join(sys.argv[1:])} for r in rows]
    previous = ROOT / "benchmarks" / "results" / f"learning_{args.suite}.json"
    if previous.exists():  # arms run earlier (e.g. one at a time) keep their rows unless run again
        done = {(r["setting"], r.get("arm"), r.get("seed")) for r in rows}
        rows = [r for r in json.loads(previous.read_text())["rows"]
                if (r.get("setting", "default"), r.get("arm"), r.get("seed")) not in done] + rows
    report(f"learning_{args.suite}", rows)
    if args.suite == "retrieval":
        plot([r for r in rows if r.get("setting", "default") == args.name], "retrieval", setting=args.name)


if __name__ == "__main__":
    main()

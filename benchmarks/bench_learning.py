"""Proof that the recipes learn what the papers report, on this machine.

    python benchmarks/bench_learning.py --suite quickstart [--config configs/quickstart_paging.yaml --name paging]
        [--seeds 0 1] [key=value ...]
    python benchmarks/bench_learning.py --suite retrieval [--seeds 0 1] [key=value ...]
    python benchmarks/bench_learning.py --suite retrieval --model tiny [--sft-steps 60 --rl-steps 40 --eval-limit 200]
    python benchmarks/bench_learning.py --suite armed [--model tiny] [--sft-steps 10 --rl-steps 16]

key=value overrides (e.g. a larger tiny model: model.tiny.hidden_size=256) apply to every arm, its demonstrations and
its evaluation; --name keeps each setting's runs apart (outputs/bench_learning/<name>/).

quickstart: configs/quickstart.yaml as shipped (SmolLM2-135M-Instruct: cold start on expert demonstrations, then GRPO
with retrieval), or the config --config names (e.g. the paging setting), once per seed; every evaluation the run makes
(the base model, after the cold start, after GRPO; each split of eval.data) with its search behaviour (the gold
option linked in any search and in the first, accuracy split by whether the first search linked it), read from the
run's own eval.json, with the wall-clock of the whole run including start-up.
retrieval: the HPO diagnosis task, evaluated on held-out diseases (hpo:mcq_test: no test disease occurs in training,
so only retrieval can answer). On the real model (default), two quickstart runs per seed, each evaluated after its
cold start and after its GRPO stage: as shipped (sft_only, grpo_retrieval) and with retrieval off, its cold start on
think-then-answer demonstrations (sft_direct, grpo_no_retrieval); same steps, lr and rewards otherwise; and the
quickstart's GRPO stage again from the same cold start with Med-RwR's query-semantic and confidence-gain rewards added
(grpo_retrieval_rwr); and the policy reading passages (five a search, no option links, answers as the option's
text) after a cold start as long as the quickstart's (passages), four times as long (passages_long), or as long but
from the weights of the cold start on linked titles (passages_curriculum); and passages_long's GRPO stage again from
its cold start with Med-RwR's two rewards added (passages_long_grpo_rwr).
On the tiny Qwen2 (--model tiny): two cold starts of S SFT steps each, and R GRPO steps (at --rl-lr) from them:
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
component over R GRPO steps (goal: adaptive stays >= 0.25 where static falls below 0.1) and each arm's BLEU-1,
ROUGE-1 and BERTScore on held-out cases (hpo:open_test, greedy), both from one SFT cold start
of S steps on direct demonstrations (ARMed trains a model that already answers; --sft-steps 0: from the model's own
weights), on the real model with the quickstart's settings (GRPO at 1e-5) or on the tiny Qwen2 (--model tiny).
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
from benchmarks.plot_learning import plot  # noqa: E402

PYTHON = sys.executable
RUNS = ROOT / "outputs" / "bench_learning"  # /<--name>/ (the tiny model's: /tiny/<--name>/): one folder per setting
TINY = "configs/tiny.yaml"  # the tiny random model of `--model tiny`
QUICKSTART = "configs/quickstart.yaml"  # the real model's suites start from it
SINGLE_TURN = ["rollout.grammar.action_tag=null", "retrieval=null"]
# A query lists a case's phenotypes (~40-60 tokens): room for it in one generation turn, for training and evaluation.
LENGTHS = ["rollout.max_new_tokens=96", "rollout.grammar.max_response_tokens=320"]
# Adam's first steps at full lr knock a fresh model off course: SFT loss 4.3 vs 1.9 after 40 steps without/with these
# 10 warm-up steps (tiny Qwen2, retrieval demonstrations, lr 5e-3).
WARMUP = ["learner.warmup_steps=10"]
# Each model's config and what every run of a suite adds to it: (config, overrides, SFT batch, GRPO lr after a cold
# start). The real model keeps the quickstart's lengths, warm-up and SFT batch.
MODELS = {"tiny": (TINY, [*LENGTHS, *WARMUP], 32, 3e-4),
          "real": (QUICKSTART, ["eval=null"], 16, 1e-5)}
FORMAT_ACCURACY = "rewards.components=[{name: tag_format, args: {tags: [answer]}}, {name: accuracy, weight: 2.0}]"
RWR = ("rewards.components=[{name: tag_format, args: {tags: [answer]}}, {name: accuracy, weight: 2.0}, "
       "{name: query_semantic_text, weight: 0.4}, {name: confidence_gain, weight: 1.0}]")
# The quickstart's rewards with Med-RwR's two added at the weights above.
RWR_REAL = ("rewards.components=[{name: tag_format, args: {tags: [answer]}}, {name: valid_option, weight: 0.5}, "
            "{name: accuracy}, {name: query_semantic_text, weight: 0.4}, {name: confidence_gain, weight: 1.0}]")


def demonstrations(runs: Path, kind: str, args, data: str = "hpo:mcq_train", overrides: tuple = ()) -> Path:
    """Expert demonstrations for a training split (by default the multiple-choice one): with retrieval (the
    quickstart's grammar, or the setting `kind` names with its `overrides`) or direct."""
    from learners.config import load_config
    from learners.expert import write_demonstrations
    split = "" if data == "hpo:mcq_train" else f"{data.split(':')[-1]}_"
    out = runs / f"demos_{kind}_{split}{args.answer_with}.jsonl"
    if not out.exists():
        config, common, *_ = MODELS[args.model]
        cfg = load_config(ROOT / config, common + args.overrides + (SINGLE_TURN if kind == "direct" else [])
                          + list(overrides))
        print(write_demonstrations(cfg, data, out, args.demo_limit, answer_with=args.answer_with))
    return out


def train(out: Path, overrides: list[str], model: str = "tiny") -> tuple[Path, float, list[dict]]:
    """Train (unless a finished run is there); its checkpoint, its training seconds (the logged steps', so a run
    reused later keeps its time) and its metrics."""
    config, common, *_ = MODELS[model]
    if not (out / "checkpoints" / "latest").exists():
        subprocess.run([PYTHON, "learners/run.py", "--config", config, f"output_dir={out}",
                        "logging.progress_bar=false", "checkpoint.every=1000", *common, *overrides], cwd=ROOT,
                       check=True)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out / "checkpoints" / "latest", sum(m.get("step_s", 0.0) for m in metrics), metrics


def evaluate(checkpoint: Path, overrides: list[str], limit: int, model: str = "tiny",
             data: str = "hpo:mcq_test") -> dict:
    """A run's checkpoint scored on the first `limit` tasks of `data` (unless already scored)."""
    config, common, *_ = MODELS[model]
    out = checkpoint.parent.parent / f"eval_{data.split(':')[-1]}"
    if not (out / "eval.json").exists():
        subprocess.run([PYTHON, "-m", "learners.evaluate", "--config", config, "--checkpoint", str(checkpoint),
                        "--data", data, "--limit", str(limit), "--out", str(out), *common, *overrides],
                       cwd=ROOT, check=True)
    return json.loads((out / "eval.json").read_text())


def text_scores(result: dict) -> dict:
    """An open-ended evaluation's means (and 95% intervals) of BLEU-1, ROUGE-1 and BERTScore F1."""
    return {k: f"{result[k]['mean']:.3f} [{result[k]['low']:.3f}, {result[k]['high']:.3f}]"
            for k in ("bleu1", "rouge1", "bertscore")}


def cold_start(steps: int, demos: Path, model: str = "tiny") -> list[str]:
    """Overrides for a run that is one SFT stage of `steps` steps on `demos`."""
    return [f"total_steps={steps}", "stages=[{name: cold_start, kind: sft, steps: %d, sft: {data: %s, batch_size: %d}}]"
            % (steps, demos, MODELS[model][2])]


def grpo_only(steps: int) -> list[str]:
    """Overrides for a run that is one GRPO stage of `steps` steps."""
    return [f"total_steps={steps}", "stages=[{name: grpo, kind: grpo, steps: %d}]" % steps]


def runs_dir(args) -> Path:
    return RUNS / args.name if args.model == "real" else RUNS / "tiny" / args.name


def plot_setting(args) -> str:
    """A plot's name suffix: the setting's name, prefixed real_ for the real model."""
    return args.name if args.model == "tiny" else f"real_{args.name}"


def quickstart_rows(out: Path, seed: int, overrides: list[str], config: str = QUICKSTART) -> list[dict]:
    """`config` for one seed (run unless its eval.json is there): one row per evaluation of the run (base, after the
    cold start when eval.every asks, after GRPO; each split), read from the run's own eval.json; the run's wall-clock
    includes Ray and actor start-up."""
    wall = None
    if not (out / "eval.json").exists():
        start = time.perf_counter()
        subprocess.run([PYTHON, "learners/run.py", "--config", config, f"output_dir={out}", f"seed={seed}",
                        "logging.progress_bar=false", *overrides], cwd=ROOT, check=True)
        wall = time.perf_counter() - start
    from learners.config import load_config
    from learners.validation import weights_label
    cfg = load_config(out / "config.yaml")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timing = {"train_minutes": round(sum(m.get("step_s", 0.0) for m in metrics) / 60, 1),
              "eval_minutes": round(sum(m.get("eval_s", 0.0) for m in metrics) / 60, 1),
              "wall_minutes": round(wall / 60, 1) if wall else None}
    rows = []
    for split, by_step in json.loads((out / "eval.json").read_text())["splits"].items():
        for step, m in sorted(by_step.items(), key=lambda item: int(item[0])):
            acc = m["accuracy"]
            rows.append({"seed": seed, "split": split, "weights": weights_label(cfg, int(step)), "step": int(step),
                         "accuracy": round(acc["mean"], 4), "ci95": f"[{acc['low']:.3f}, {acc['high']:.3f}]",
                         "n": acc["n"], "format_rate": round(m["format_rate"]["mean"], 3),
                         "retrievals_per_question": round(m["env_calls_per_sample"], 2),
                         "gold_retrieved": round(m["gold_retrieved"]["mean"], 3) if "gold_retrieved" in m else None,
                         # a policy right whenever its search finds the gold disease, guessing otherwise (4 options)
                         "retrieval_bound": round(0.25 + 0.75 * m["gold_retrieved"]["mean"], 3)
                         if "gold_retrieved" in m else None, **search_behaviour(m), **timing})
    return rows


def search_behaviour(metrics: dict) -> dict:
    """What an evaluation's episodes did with their searches (multiple-choice tasks with linked options): the gold
    option linked in any search and in the first; accuracy where the first search linked it and where it did not,
    each with its count; with the options' ranking (retrieval.rank_options), how often it put the gold first, the
    accuracy then, and how often the answer named its first option."""
    keys = ("gold_linked", "gold_linked_first", "gold_ranked_first", "accuracy_first_linked", "accuracy_first_unlinked",
            "accuracy_gold_ranked_first", "follows_ranking")
    return {key: round(metrics[key]["mean"], 3) for key in keys if key in metrics} | \
        {f"n_{key}": metrics[key]["n"] for key in keys[2:] if key in metrics}


def quickstart_suite(args) -> list[dict]:
    return [row for seed in args.seeds
            for row in quickstart_rows(runs_dir(args) / f"quickstart_seed{seed}", seed, args.overrides, args.config)]


def grpo_stage(grpo) -> str:
    """The quickstart's GRPO stage (its steps and learning rate) as a `stages` list item."""
    return "{name: grpo, kind: grpo, steps: %d, set: {learner.lr: %.6e}}" % (grpo.steps, grpo.set["learner.lr"])


def real_retrieval_settings(args, seed: int, cold, grpo) -> dict[str, tuple[Path, list[str], tuple]]:
    """{setting: (run folder, overrides, (arm after the cold start, arm after GRPO))} of one seed on the real model,
    given the quickstart's two stages."""
    shipped, both = runs_dir(args) / f"quickstart_seed{seed}", f"eval.every={cold.steps}"

    def run(setting: str) -> Path:  # a setting's run folder beside the shipped quickstart's
        return shipped.with_name(f"{shipped.name}_{setting}")
    cold_start_weights = shipped / "checkpoints" / f"step_{cold.steps}"
    long_steps = cold_start_steps("passages_long", cold)
    long_cold_start_weights = run("passages_long") / "checkpoints" / f"step_{long_steps}"

    def rwr(weights: Path) -> list[str]:  # the quickstart's GRPO stage from `weights`, Med-RwR's rewards added
        return [f"model.path={weights}", "eval.at_start=false", f"total_steps={grpo.steps}",
                f"stages=[{grpo_stage(grpo)}]", RWR_REAL, "recipe=med_rwr"]
    return {"retrieval": (shipped, [both], ("sft_only", "grpo_retrieval")),
            "no_retrieval": (run("no_retrieval"), [both, *SINGLE_TURN], ("sft_direct", "grpo_no_retrieval")),
            "rwr": (run("rwr"), rwr(cold_start_weights), (None, "grpo_retrieval_rwr")),
            "passages": (run("passages"), [both, *PASSAGES], ("passages_sft", "passages_grpo")),
            "passages_long": (run("passages_long"),
                              [f"eval.every={long_steps}", "eval.at_start=false", *PASSAGES],
                              ("passages_long_sft", "passages_long_grpo")),
            "passages_curriculum": (run("passages_curriculum"),
                                    [both, f"model.path={cold_start_weights}", "eval.at_start=false", *PASSAGES],
                                    ("passages_curriculum_sft", "passages_curriculum_grpo")),
            "passages_rwr": (run("passages_rwr"), [*rwr(long_cold_start_weights), *PASSAGES],
                             (None, "passages_long_grpo_rwr"))}


REAL_SETTINGS = ("retrieval", "no_retrieval", "rwr", "passages", "passages_long", "passages_curriculum",
                 "passages_rwr")
# Each passages setting's cold start, in multiples of the quickstart's: passages_long reads 4x the demonstrations;
# passages_curriculum reads as many, from the weights the quickstart's cold start on linked titles left.
PASSAGES_COLD_START = {"passages": 1, "passages_long": 4, "passages_curriculum": 1}


def cold_start_steps(setting: str, cold) -> int:
    """The SFT steps of `setting`'s cold start, given the quickstart's cold-start stage."""
    return PASSAGES_COLD_START.get(setting, 1) * cold.steps


# Settings that start from another setting's cold start (its run must be there).
STARTS_FROM = {"rwr": "retrieval", "passages_curriculum": "retrieval", "passages_rwr": "passages_long"}
# The passages setting: five passages, each cut to its first ~50 tokens (the name line, then phenotypes by frequency),
# fit the observation; whole, one fills it.
PASSAGES = ["retrieval.show=passages", "retrieval.link_options=false", "retrieval.passage_chars=200",
            "retrieval.search.top_k=5", "rollout.grammar.max_observation_tokens=320",
            "rollout.grammar.max_response_tokens=480"]


def real_retrieval_suite(args) -> list[dict]:
    """The retrieval settings on the real model, one run each per seed (--arms: a subset): the quickstart as shipped,
    evaluated after its cold start too (sft_only, grpo_retrieval; the quickstart suite's run of that seed); the same
    run with retrieval off, cold start on direct demonstrations (sft_direct, grpo_no_retrieval); the quickstart's GRPO
    stage from that cold start's checkpoint with Med-RwR's rewards added (grpo_retrieval_rwr); and the policy reading
    passages, five a search cut to 200 characters each, no option links, answering with the option's text
    (passages_sft, passages_grpo; passages_long_* after a cold start 4x as long; passages_curriculum_* after one
    from the linked-titles cold start's weights; passages_long_grpo_rwr: passages_long's GRPO stage with Med-RwR's
    rewards added)."""
    from learners.config import load_config
    cold, grpo = load_config(ROOT / QUICKSTART).stage_plan()
    rows = []
    for seed in args.seeds:
        settings = real_retrieval_settings(args, seed, cold, grpo)
        for name, (out, extra, (after_sft, after_grpo)) in settings.items():
            if name not in (args.arms or REAL_SETTINGS):
                continue
            if name in STARTS_FROM and not (settings[STARTS_FROM[name]][0] / "eval.json").exists():
                raise SystemExit(f"the {name} setting starts from the {STARTS_FROM[name]} setting's cold start: run "
                                 f"--arms {STARTS_FROM[name]} --seeds {seed} first")
            sft_steps = cold_start_steps(name, cold)  # where the row after the cold start is
            if name in PASSAGES_COLD_START:  # the cold start answers with the option's text, copied from the hit
                demos = demonstrations(runs_dir(args), "passages", args, overrides=tuple(PASSAGES))
                cold_stage = "{name: cold_start, kind: sft, steps: %d, sft: {data: %s, batch_size: %d}}" % (
                    sft_steps, demos, MODELS["real"][2])
                extra = [*extra, f"stages=[{cold_stage}, {grpo_stage(grpo)}]",
                         f"total_steps={sft_steps + grpo.steps}"]
            for row in quickstart_rows(out, seed, [*extra, *args.overrides]):
                if row["step"] == 0 and name != "retrieval":  # the base model is measured once per seed
                    continue
                arm = "base" if row["step"] == 0 else after_sft if after_sft and row["step"] == sft_steps \
                    else after_grpo
                rows.append({"arm": arm, **row})
    return rows


def retrieval_suite(args) -> list[dict]:
    """The retrieval arms on the tiny random model (--model tiny), each its own run."""
    s, r, runs = args.sft_steps, args.rl_steps, runs_dir(args)
    retrieval_demos, direct_demos = demonstrations(runs, "retrieval", args), demonstrations(runs, "direct", args)
    # GRPO continues from a cold start's checkpoint with a much lower lr: at the SFT lr (3e-3) 20 steps wiped out
    # what SFT taught (greedy outputs degenerated to repeated tokens).
    rl = [*grpo_only(r), f"learner.lr={args.rl_lr or MODELS['tiny'][3]}"]
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
    runs, task = runs_dir(args), ["data.train=hpo:open_train", *SINGLE_TURN]
    answer = ["rollout.stop=[</answer>]", "rollout.max_new_tokens=32"]
    base = [*task, *grpo_only(args.rl_steps), *answer, "rollout.temperature=0.7", "algorithm.dynamic_sampling=false"]
    rows, curves = [], {}

    def held_out(checkpoint: Path) -> dict:
        return text_scores(evaluate(checkpoint, [*SINGLE_TURN, *answer, *args.overrides], args.eval_limit,
                                    args.model, "hpo:open_test"))

    if args.sft_steps:  # ARMed starts RL from a model that already answers: both arms from one SFT cold start
        demos = demonstrations(runs, "direct", args, data="hpo:open_train")
        cold, *_ = train(runs / "armed_cold_start", [f"seed={args.seed}", *args.overrides, *task,
                                                      *cold_start(args.sft_steps, demos, args.model)], args.model)
        base += [f"model.path={cold.resolve()}", f"learner.lr={args.rl_lr or MODELS[args.model][3]}"]
        rows.append({"arm": "armed_cold_start", **held_out(cold)})
    for adaptive in (True, False):
        name = f"armed_{'adaptive' if adaptive else 'static'}"
        rewards = ("rewards.components=[{name: armed_textual, weight: 0.4}, {name: armed_semantic, weight: 0.4, "
                   "args: {adaptive: %s}}, {name: tag_format, weight: 0.2, args: {tags: [answer]}}]"
                   % str(adaptive).lower())
        checkpoint, seconds, metrics = train(runs / name, [f"seed={args.seed}", *args.overrides, *base, rewards],
                                             args.model)
        nci = [m.get("nci/armed_semantic", 0.0) for m in metrics]
        curves[name] = nci
        tail = nci[len(nci) // 2:]
        rows.append({"arm": name, "nci_semantic_first5": round(sum(nci[:5]) / 5, 3),
                     "nci_semantic_second_half": round(sum(tail) / len(tail), 3),
                     "nci_semantic_min": round(min(nci), 3), "reward_last5": round(
                         sum(m["reward_mean"] for m in metrics[-5:]) / 5, 3), "train_minutes": round(seconds / 60, 1),
                     # what is left within a group to rank by, early and late (runs logging spread/*)
                     **{f"spread_{c}_{when}": round(sum(m.get(f"spread/armed_{c}", 0.0) for m in part) / 5, 4)
                        for c in ("semantic", "textual") for when, part in (("first5", metrics[:5]),
                                                                            ("last5", metrics[-5:]))},
                     **held_out(checkpoint)})
    plot(rows, "armed", curves, setting=None if (args.model, args.name) == ("tiny", "default") else plot_setting(args))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=["quickstart", "retrieval", "armed"], required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="quickstart: one run per seed")
    parser.add_argument("--config", default=QUICKSTART, help="quickstart: the run's config (e.g. the paging setting)")
    parser.add_argument("--model", choices=["real", "tiny"], default="real",
                        help="SmolLM2-135M-Instruct (configs/quickstart.yaml) or the tiny random model")
    parser.add_argument("--arms", nargs="*", help="retrieval: a subset of the arms (--model tiny) or of the settings "
                                                  f"(real: {' '.join(REAL_SETTINGS)})")
    parser.add_argument("--sft-steps", type=int, default=60,
                        help="cold-start SFT steps (armed: 0 = RL from random weights)")
    parser.add_argument("--rl-steps", type=int, default=40)
    parser.add_argument("--rl-lr", type=float, default=None,
                        help="the GRPO arms' learning rate after a cold start (default: 3e-4 tiny, 1e-5 real)")
    parser.add_argument("--eval-limit", type=int, default=200)
    parser.add_argument("--demo-limit", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--answer-with", choices=["letter", "text"], default="text",
                        help="how the expert answers: the option letter, or the option text (copied from the hit)")
    parser.add_argument("--name", default="default", help="runs go to outputs/bench_learning/<name>/")
    parser.add_argument("overrides", nargs="*", help="key=value for every arm (e.g. model.tiny.hidden_size=256)")
    args = parser.parse_args()
    retrieval = real_retrieval_suite if args.model == "real" else retrieval_suite
    rows = {"quickstart": quickstart_suite, "retrieval": retrieval, "armed": armed_suite}[args.suite](args)
    rows = [{**r, "setting": args.name, "model": args.model, "command": " ".join(sys.argv[1:])} for r in rows]
    previous = ROOT / "benchmarks" / "results" / f"learning_{args.suite}.json"
    if previous.exists():  # arms run earlier (e.g. one at a time) keep their rows unless run again
        def key(r: dict) -> tuple:  # rows written before settings and models were recorded: default, tiny
            return r.get("setting") or "default", r.get("model", "tiny"), r.get("arm"), r.get("seed")
        done = {key(r) for r in rows}
        rows = [r for r in json.loads(previous.read_text())["rows"] if key(r) not in done] + rows
    report(f"learning_{args.suite}", rows)
    if args.suite == "retrieval":
        plot([r for r in rows if (r.get("setting") or "default", r.get("model", "tiny")) == (args.name, args.model)],
             "retrieval", setting=plot_setting(args))


if __name__ == "__main__":
    main()

"""Score a checkpoint on a task split through rollout workers.

    python -m learners.evaluate --config configs/quickstart.yaml --checkpoint outputs/quickstart/checkpoints/latest \
        --data hpo:mcq_test [--limit 200] [--out DIR] [--cdir [--image-index DIR] [--cdir-threshold 0.8]] \
        [--judge] [dotted.key=value ...]

The config supplies the grammar (retrieval, turn limits), resources and sampling length; decoding is greedy.
Multiple choice: accuracy with a 95% Wilson interval. Real-case open diagnoses (`phenopackets:...#open_test`,
`answer_type: ranked`): `accuracy` is top-1 and `top3_accuracy` top-3 of a ranked `<answer>` (up to three names),
both with Wilson intervals, by name variant or disease id. Closed (yes/no) questions: exact-match `closed_accuracy`,
also with a Wilson interval. Open-ended: BLEU-1, ROUGE-1, BERTScore and CosSim, each with a 95% normal interval, and
with `--judge` (or `eval.judge: true`) `judge_accuracy`: the config's JudgeActor says whether each open answer is
correct, with a Wilson interval and its parse failures counted (learners/judge_eval.py). All: format rate, response
length, environment calls and errors per sample. Writes `eval.json`, `eval.md` and `samples.jsonl` into --out (default:
<run>/eval/checkpoints/<checkpoint>/<split>/ next to the run's checkpoints/, never inside a checkpoint, which
`checkpoint.keep_last` deletes in time).

`--cdir` adds Med-RwR's test-time image re-retrieval (actors/cdir.py) over an image index (`--image-index`, built by
`python -m indexing.image_index`; default: the imaging world's CDIR corpus under the tiny BiomedCLIP, built on first
use): the report gains its rows (how often it fired; accuracy and confidence before and after), and each sample its
`cdir` record (the case shown and the second answer where it fired). The metrics above are those of the first answers.
A multimodal policy is shown the similar case's image and caption before it answers again. A text-only policy on an
imaging task reads the question without its images (it cannot take them); CDIR still retrieves by the task's image and
shows it the similar case's caption.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.trajectory import RolloutSummary  # noqa: E402
from learners.config import load_config  # noqa: E402
from learners.intervals import mean_interval, proportion  # noqa: E402


def score(trajectories: list, summaries: list[RolloutSummary]) -> dict:
    """Metrics of greedy episodes, one per task: accuracy (multiple choice; for ranked open diagnoses, top-1, with
    `top3_accuracy` beside it), exact-match `closed_accuracy` (closed yes/no questions, by the task's `answer_type`),
    text similarity (other open questions), and format and tool use."""
    from rewards.builtin import answer_correct, answer_rank, extract_answer, is_ranked
    from rewards.text_similarity import bleu1, rouge1, score_against_gold

    n = len(trajectories)
    metrics = {"n": n,
               "format_rate": mean_interval([extract_answer(t.text) is not None for t in trajectories]),
               "response_length": float(np.mean([len(t.response_ids) for t in trajectories])),
               "env_calls_per_sample": sum(s.env_calls for s in summaries) / n,
               "env_errors": sum(s.env_errors for s in summaries)}
    mcq = [t for t in trajectories if t.task.get("options")]
    ranked = [t for t in trajectories if not t.task.get("options") and is_ranked(t.task)]
    with_gold_doc = [t for t in mcq + ranked if (t.task.get("metadata") or {}).get("kb_doc_id")]
    if with_gold_doc and any(t.turns for t in with_gold_doc):  # the policy could retrieve the gold document
        metrics["gold_retrieved"] = mean_interval([gold_retrieved(t) for t in with_gold_doc])
    if mcq or ranked:  # a ranked diagnosis is right at top-1: the field's Recall@1
        metrics["accuracy"] = proportion([answer_correct(t) for t in mcq + ranked])
    if mcq:
        metrics.update(option_links(mcq))
    if ranked:
        ranks = [answer_rank(t) for t in ranked]
        metrics["top3_accuracy"] = proportion([r is not None and r < 3 for r in ranks])
    closed = [t for t in trajectories if not t.task.get("options") and is_closed(t.task)]
    if closed:  # yes/no: the answer is right or wrong, so exact match (normalised), not text similarity
        metrics["closed_accuracy"] = proportion([answer_correct(t) for t in closed])
    open_ended = open_questions(trajectories)
    if open_ended:
        from rewards.semantic import load_bertscore, load_encoder
        pairwise = {"bleu1": lambda a, g: [bleu1(x, y) for x, y in zip(a, g)],
                    "rouge1": lambda a, g: [rouge1(x, y) for x, y in zip(a, g)],
                    "bertscore": load_bertscore().f1, "cos_sim": load_encoder().cosine}
        for name, fn in pairwise.items():
            metrics[name] = {**mean_interval(score_against_gold(open_ended, fn)), "n": len(open_ended)}
    return metrics


def is_closed(task: dict) -> bool:
    return (task.get("metadata") or {}).get("answer_type") == "closed"


def open_questions(trajectories: list) -> list:
    """The episodes of open questions: neither multiple choice, closed (yes/no) nor a ranked diagnosis (graded by
    name and id, not by similarity)."""
    from rewards.builtin import is_ranked
    return [t for t in trajectories if not t.task.get("options") and not is_closed(t.task) and not is_ranked(t.task)]


def gold_retrieved(trajectory) -> bool:
    """Whether any retrieval of the episode returned the task's gold knowledge-base document."""
    gold = trajectory.task["metadata"]["kb_doc_id"]
    return any(chunk.get("doc_id") == gold for turn in trajectory.turns for chunk in turn.get("chunks", []))


def option_links(mcq: list) -> dict:
    """How a retrieval agent's searches linked the gold option on multiple-choice episodes `mcq`, read from each turn's
    `linked` letters (retrieval.link_options; nothing when no turn has them): `gold_linked`, whether any search's hits
    were marked "(option X)" for the gold X; `gold_linked_first`, whether the first search's were; and accuracy split
    by the latter, `accuracy_first_linked` and `accuracy_first_unlinked` (an episode that never searched is unlinked;
    a split with no episode is left out). Where the first search's hits linked none and the options' ranking followed
    (retrieval.rank_options): `gold_ranked_first`, whether it ranked the gold option first, the accuracy of
    those that did, `accuracy_gold_ranked_first`, and `follows_ranking`, whether the answer named the ranking's first
    option. Each a proportion with its Wilson interval and n."""
    from rewards.builtin import answer_correct, chosen_option

    if not any("linked" in turn for t in mcq for turn in t.turns):
        return {}
    gold = [[t.task["answer"].strip().upper() in turn.get("linked", []) for turn in t.turns] for t in mcq]
    first = [bool(turns) and turns[0] for turns in gold]
    correct = [answer_correct(t) for t in mcq]
    split = {"accuracy_first_linked": [c for c, f in zip(correct, first) if f],
             "accuracy_first_unlinked": [c for c, f in zip(correct, first) if not f]}
    shown = [(t, c) for t, c in zip(mcq, correct) if t.turns and t.turns[0].get("options_ranked")]
    ranked = [(t.turns[0]["options_ranked"][0] == t.task["answer"].strip().upper(), c) for t, c in shown]
    split["accuracy_gold_ranked_first"] = [c for gold_first, c in ranked if gold_first]
    followed = [chosen_option(t) == t.turns[0]["options_ranked"][0] for t, _ in shown]
    return {"gold_linked": proportion([any(turns) for turns in gold]), "gold_linked_first": proportion(first),
            **({"gold_ranked_first": proportion([g for g, _ in ranked]),
                "follows_ranking": proportion(followed)} if ranked else {}),
            **{k: proportion(v) for k, v in split.items() if v}}


def sample_record(trajectory) -> dict:
    from rewards.builtin import answer_correct, answer_rank, extract_answer, is_ranked
    record = {"answer": extract_answer(trajectory.text), "correct": answer_correct(trajectory)}
    if is_ranked(trajectory.task):
        record["rank"] = answer_rank(trajectory)  # 0-based place of the gold name in the ranked answer, or None
    return {**record, "text": trajectory.text}


def write_samples(path: Path, trajectories: list, cdir: dict | None = None, reanswers: list | None = None) -> None:
    """One line per episode: task id, gold, the response text, its answer and whether it is correct. With `cdir`
    (apply_cdir's summary, `reanswers` its trajectories), each line's `cdir`: whether it fired, the confidence before
    and after and, where it fired, the case shown (id, caption, image path, score, whether its image was shown) and
    the second answer (`reanswer`: answer, correct, text)."""
    from cluster.files import write_jsonl

    rows = [{"id": t.task.get("id"), "gold": t.task.get("answer"), **sample_record(t)} for t in trajectories]
    for row, episode, again in zip(rows, (cdir or {}).get("episodes", []), reanswers or []):
        row["cdir"] = {k: v for k, v in episode.items() if k != "task_id"}
        if episode["fired"]:
            row["cdir"]["reanswer"] = sample_record(again)
    write_jsonl(path, rows)


def markdown(metrics: dict, title: str) -> str:
    rows = ["| metric | value | 95% interval |", "|---|---|---|"]
    for name, value in metrics.items():
        if name == "cdir":
            continue
        if isinstance(value, dict):
            rows.append(f"| {name} | {value['mean']:.4f} | [{value['low']:.4f}, {value['high']:.4f}] |")
        else:
            rows.append(f"| {name} | {value:.4g} | |" if isinstance(value, float) else f"| {name} | {value} | |")
    text = f"## {title}\n\n" + "\n".join(rows) + "\n"
    return text + (cdir_markdown(metrics["cdir"]) if "cdir" in metrics else "")


def cdir_markdown(summary: dict) -> str:
    """The CDIR rows: how often it fired, and accuracy and mean confidence before -> after, on all and on fired."""
    def fmt(value):
        return "-" if value is None else f"{value:.4f}"

    rows = ["| CDIR | before | after |", "|---|---|---|",
            f"| fired (eta < {summary['threshold']}) | {summary['fired']} of {summary['n']} "
            f"({summary['fire_rate']:.1%}) | |",
            f"| episodes without an answer token (never fire) | {summary['without_confidence']} | |"]
    for label, key in (("accuracy", "accuracy"), ("mean confidence", "confidence"),
                       ("accuracy, fired only", "fired_accuracy"), ("mean confidence, fired only", "fired_confidence")):
        rows.append(f"| {label} | {fmt(summary[key + '_before'])} | {fmt(summary[key + '_after'])} |")
    return "\n### CDIR (Med-RwR test-time image re-retrieval)\n\n" + "\n".join(rows) + "\n"


def text_only_view(tasks: list[dict], policy_path: str) -> list[dict]:
    """The tasks as a text-only policy reads them: without their images (it cannot take them)."""
    from actors.image_tokens import ImageTokens
    return [{**t, "images": []} for t in tasks] if ImageTokens.for_model(policy_path) is None else tasks


def run_episodes(workers: list, tasks: list[dict], sampling: dict, seed: int, batch_size: int = 64,
                 grammar: dict | None = None, desc: str = "evaluate", version: int = 0,
                 restore=None) -> tuple[list, list[RolloutSummary]]:
    """One episode per task on `workers` (spread evenly, `batch_size` tasks per call on each), in task order;
    returns the trajectories and the workers' summaries. A share lost with its worker is generated again
    (learners/fleet.py `gather_shares`, with `version` and `restore` as there), so each task is answered once."""
    import ray
    from tqdm import tqdm

    from actors.rollout_worker import RolloutCall
    from learners.fleet import gather_shares, send_shares

    trajectories, summaries = [], []
    with tqdm(total=len(tasks), desc=desc, unit="task", leave=False) as bar:
        for start in range(0, len(tasks), batch_size * len(workers)):
            batch = tasks[start:start + batch_size * len(workers)]
            chunks = [c for c in np.array_split(np.arange(len(batch)), len(workers)) if len(c)]
            busy = workers[:len(chunks)]  # array_split puts the empty chunks last
            calls = [RolloutCall([batch[i] for i in c], c.tolist(), 1, sampling, seed, grammar) for c in chunks]
            shares, summary_refs = send_shares(busy, calls)
            summaries += gather_shares(busy, calls, shares, summary_refs, desc, version, restore)
            trajectories += [t for share in ray.get(shares) for t in share]
            bar.update(len(batch))
    return trajectories, summaries


def eval_grammar(cfg, grammar: dict) -> dict:
    """The grammar episodes are evaluated with: the run's, with `eval.max_turns` when the config sets it."""
    limit = cfg.eval.max_turns if cfg.eval is not None else None
    return grammar if limit is None else {**grammar, "max_turns": limit}


def greedy_sampling(cfg) -> dict:
    return {"temperature": 0.0, "max_tokens": cfg.rollout.max_new_tokens, "stop": cfg.rollout.stop}


def evaluate(cfg, checkpoint: str, data: str, limit: int | None, batch_size: int = 64, cdir: bool = False,
             image_index: str | None = None, cdir_threshold: float = 0.8, samples: Path | None = None,
             judge: bool = False) -> dict:
    """Greedy episodes for every task of `data` on rollout workers loaded from `checkpoint`, then their metrics;
    with `cdir`, Med-RwR's image re-retrieval over `image_index` afterwards, its summary under "cdir". `samples`:
    a JSONL to write each episode to (task id, gold, the response text, its answer and whether it is correct).
    `judge` (or the config's `eval.judge`): a JudgeActor from the config's `judge` section grades the open answers
    (learners/judge_eval.py)."""
    from learners.data import load_tasks
    from learners.fleet import Fleet
    from learners.judge_eval import judge_open_answers
    from learners.services import environment_roles

    judge = judge or bool(cfg.eval and cfg.eval.judge)
    if judge and cfg.judge is None:
        raise ValueError("judge-graded evaluation needs the config's `judge` section (judge.backend vllm with "
                         "judge.model_path, or openai with judge.base_url and judge.model)")
    with Fleet(cfg, ("rollout",) + environment_roles(cfg) + (("judge",) if judge else ()), judge=judge) as fleet:
        fleet.join_ray()
        tasks = load_tasks(data)[:limit]
        fleet.place()
        fleet.start_services()
        workers = fleet.start_workers(checkpoint, name="EvalRolloutWorker")
        sampling = greedy_sampling(cfg)
        trajectories, summaries = run_episodes(workers, text_only_view(tasks, checkpoint), sampling, cfg.seed,
                                               batch_size, eval_grammar(cfg, cfg.rollout.grammar.model_dump()))
        for traj, task in zip(trajectories, tasks):
            traj.task = task  # scoring and CDIR read the task as written, images included
        metrics, reanswers = score(trajectories, summaries), None
        if fleet.judge is not None:
            metrics.update(judge_open_answers(open_questions(trajectories), fleet.judge))
        if cdir:
            from transformers import AutoTokenizer

            from actors.image_tokens import ImageTokens
            from actors.image_retriever import ImageRetriever
            from indexing.image_index import ensure_image_index
            from actors.cdir import apply_cdir

            index_dir = image_index or str(ensure_image_index(progress=True))
            image_retriever = ImageRetriever.options(num_cpus=0, name="EvalImageRetriever-0").remote(index_dir)
            fleet.others.append(image_retriever)
            reanswers, metrics["cdir"] = apply_cdir(
                trajectories, workers, image_retriever, AutoTokenizer.from_pretrained(checkpoint),
                cfg.rollout.grammar, sampling, cfg.seed, cdir_threshold, vision=ImageTokens.for_model(checkpoint))
            metrics["cdir"]["image_index"] = index_dir
        if samples is not None:
            write_samples(samples, trajectories, metrics.get("cdir"), reanswers)
    return metrics


def split_dir_name(split: str) -> str:
    """A split as a directory name: hpo:mcq_test -> hpo_mcq_test; a file path -> its stem."""
    name = Path(split).stem if split.endswith(".jsonl") else split
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def default_out(cfg, checkpoint: str, data: str) -> Path:
    """Where `python -m learners.evaluate` writes without --out: <run>/eval/checkpoints/<checkpoint>/<split>/, <run>
    being the run whose checkpoints/ holds the checkpoint (`latest` resolved to its step), else the config's
    output_dir. Never inside the checkpoint: `checkpoint.keep_last` deletes old ones. The run's own evaluations are
    eval/step_<N>/, which this path does not touch."""
    path = Path(checkpoint).resolve()
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else Path(cfg.output_dir)
    return run_dir / "eval" / "checkpoints" / path.name / split_dir_name(data)


def write_report(out: Path, metrics: dict, title: str, header: dict) -> None:
    """eval.json (`header`, then the metrics) and eval.md into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps({**header, **metrics}, indent=1))
    (out / "eval.md").write_text(markdown(metrics, title))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--checkpoint", required=True, help="a Hugging Face model directory")
    parser.add_argument("--data", required=True, help="JSONL of task records, hpo:<split> or "
                                                      "phenopackets:<path>#<split>")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--out", default=None, help="report directory (default: <run>/eval/checkpoints/<checkpoint>/"
                                                    "<split>/, outside the checkpoint)")
    parser.add_argument("--cdir", action="store_true", help="Med-RwR confidence-driven image re-retrieval")
    parser.add_argument("--image-index", default=None, help="image index dir (python -m indexing.image_index); "
                                                            "default: the imaging world's, built on first use")
    parser.add_argument("--cdir-threshold", type=float, default=0.8, help="re-retrieve when confidence is below")
    parser.add_argument("--judge", action="store_true", help="grade open answers with the config's judge "
                                                             "(judge_accuracy)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if (args.image_index or args.cdir_threshold != 0.8) and not args.cdir:
        parser.error("--image-index and --cdir-threshold need --cdir")
    cfg = load_config(args.config, args.overrides)
    out = Path(args.out) if args.out else default_out(cfg, args.checkpoint, args.data)
    out.mkdir(parents=True, exist_ok=True)
    metrics = evaluate(cfg, args.checkpoint, args.data, args.limit, cdir=args.cdir, image_index=args.image_index,
                       cdir_threshold=args.cdir_threshold, samples=out / "samples.jsonl", judge=args.judge)
    title = f"{args.checkpoint} on {args.data}"
    write_report(out, metrics, title, {"checkpoint": args.checkpoint, "data": args.data})
    print(markdown(metrics, title))
    return 0


if __name__ == "__main__":
    sys.exit(main())

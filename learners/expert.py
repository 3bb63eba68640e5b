"""Scripted-expert demonstrations for cold starts (SFT before RL): episodes written in a recipe's tag grammar, with
the environment's turns produced by the real environment, exactly as a rollout would see them.

    python -m learners.expert --config configs/med_rwr.yaml --data hpo:mcq_train --out demos.jsonl [--limit N] [key=value ...]
    python -m learners.expert --config configs/medvistagym.yaml --data imaging:finding_mcq_train --out demos.jsonl

The run config says which grammar, environment and tokenizer to follow:
- reasoning with retrieval (a `retrieval` section; Med-RwR's <query>/<retrieve>, Med-R3's <search>/<document>): the
  expert thinks, queries the knowledge base with the patient's phenotypes (an imaging task: its finding's name), reads
  the hits (the real retriever over the run's index, formatted and cut to `max_observation_tokens` as the rollout
  engine does), and answers with the gold option. A diagnosis task whose gold disease is not among the hits the policy
  would see gets no demonstration (the count is reported), unless the stage's `sft.expert_unlinked` is `guess`.
- tools (a `tools` section; MedVR, MedVistaGym): the expert zooms into the gold box through the real tool actors
  (`actors.gym.MedicalGym`), then, when the recipe allows retrieve_knowledge, looks the finding up, then answers.
- single turn: think, then answer.

Each line is {"task", "segments": [{"role": "policy" | "environment", "text", "images"?}]}: what an `sft` stage
trains on, environment segments masked from the loss. Image observations (crops) are saved as PNG beside the output
(`<out>.images/`) and listed in their segment's `images`.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

from actors.image_tokens import image_layout
from cluster.files import write_jsonl


def expert_query(task: dict) -> str:
    """What the expert searches: an imaging task's finding name, else the phenotypes its question lists."""
    metadata = task.get("metadata") or {}
    if metadata.get("hpo_name") and task.get("images"):
        return metadata["hpo_name"]
    if "phenotype_names" not in metadata:
        raise ValueError(f"task {task.get('id')!r}: no metadata.phenotype_names, the phenotypes the scripted expert "
                         f"searches (the HPO world's and phenopackets' diagnosis tasks carry them)")
    return "; ".join(metadata["phenotype_names"])


def cut_observation(grammar, body: str, tokenizer) -> str:
    """The environment's turn as the rollout engine inserts it: wrapped in the grammar's tags, cut to its limit."""
    ids = tokenizer.encode(grammar.wrap_observation(body), add_special_tokens=False)
    return tokenizer.decode(ids[:grammar.max_observation_tokens], skip_special_tokens=False)


def answer_segment(task: dict, grammar, thought: str, answer_with: str = "letter", letter: str | None = None) -> dict:
    """The closing turn: the thought, then the gold option (or `letter`, another option) by its letter or, with
    `answer_with="text"`, its text (the accuracy reward takes either). A small model copies a disease name from the
    retrieved text far more easily than it maps that name to a letter."""
    letter, tag = letter or task["answer"], grammar.answer_tag
    answer = task["options"][letter] if answer_with == "text" and task.get("options") else letter
    return {"role": "policy", "text": f"<think>{thought}</think>\n<{tag}>{answer}</{tag}>"}


def task_draw(task: dict, salt: str = "") -> int:
    """A 32-bit number fixed by the task's id (and `salt`): the expert's per-task choices, the same on every run."""
    return int.from_bytes(hashlib.sha256(f"{salt}{task.get('id')}".encode()).digest()[:4], "big")


def guessed_option(task: dict) -> str:
    """The option an expert without evidence answers: one of the task's options, uniform over tasks, fixed by the
    task's id (so it is right on about one task in as many as there are options)."""
    letters = sorted(task["options"])
    return letters[task_draw(task, "guess:") % len(letters)]


def retrieval_demonstration(task: dict, grammar, environment, result: list[dict], tokenizer,
                            answer_with: str = "letter", next_page: bool = False,
                            unlinked: str = "ranking") -> dict | None:
    """Think, query, read, answer. `environment` (the run's RetrievalEnvironment) shows `result`, the search's hits
    (with the options' ranking, rank_options) as a rollout would. A diagnosis task whose gold disease a hit shows is
    answered with it; `unlinked` (sft.expert_unlinked) says what the expert does when none does: `ranking` answers
    the options' ranking where it puts the gold first, else leaves the task out (None); `skip` leaves it out;
    `guess` answers `guessed_option`, as a teacher who must answer without evidence. `next_page`: the expert asks for
    the next page (the same query again, retrieval.paging) and reads it before it answers from whichever of the two
    shows the gold disease."""
    action, query = grammar.action_tag, expert_query(task)
    options = task.get("options") if environment.link_options else None
    doc_id = (task.get("metadata") or {}).get("kb_doc_id")
    turns, observations, shown, ranked = [], [], [], []
    for _ in range(2 if next_page else 1):
        first = environment.page(turns, query) * environment.top_k
        observation = environment.observation(turns, task.get("options"), query, result, None)
        turns.append(observation.record)
        observations.append(seen := cut_observation(grammar, observation.text, tokenizer))
        page = environment.page_hits(result, first)
        shown += gold_shown(page, first, seen, doc_id, environment.show, options) if doc_id else []
        if observation.record.get("options_ranked") and observation.text.splitlines()[-1] in seen:
            ranked.append(observation.record["options_ranked"][0])  # the whole ranking line is seen
    letter = None  # the gold option's, unless the expert guesses
    if not doc_id:
        thought = "The retrieved knowledge and the image agree."
    elif shown and options and answer_with == "letter":  # the link names the letter: no need to restate the title
        thought = f"The knowledge base links option {task['answer']}."
    elif shown:
        thought = f"The knowledge base names {shown[0]['title']}" + \
            (f": option {task['answer']}." if answer_with == "letter" else ".")
    elif unlinked == "ranking" and ranked and ranked[0] == task["answer"]:
        thought = f"The search ranks option {task['answer']} first."
    elif unlinked == "guess" and options:
        thought, letter = "The search does not settle it.", guessed_option(task)
    else:  # the gold document was not retrieved, or cut from what the policy would see
        return None
    segments = [{"role": "policy", "text": f"<think>What is known about these findings? Look it up.</think>\n"
                                           f"<{action}>{query}</{action}>"},
                {"role": "environment", "text": observations[0]}]
    if next_page:
        segments += [{"role": "policy", "text": f"<think>Are there more results?</think>\n<{action}>{query}</{action}>"},
                     {"role": "environment", "text": observations[1]}]
    return {"task": task, "segments": segments + [answer_segment(task, grammar, thought, answer_with, letter)]}


def gold_shown(page: list[dict], first_rank: int, observation: str, doc_id: str, show: str,
               options: dict | None) -> list[dict]:
    """The hits of `page` that are the gold document and whose whole header the policy sees in `observation`."""
    from actors.retrieval_env import hit_header
    end = ":" if show == "passages" else "\n"  # the whole header is shown, not cut
    return [h for rank, h in enumerate(page, first_rank)
            if h.get("doc_id") == doc_id and hit_header(rank, h, options) + end in observation]


def rechecks(task: dict, rate: float) -> bool:
    """Whether the expert asks for the next page on `task`: a fixed share `rate` of tasks, by the task's id."""
    return task_draw(task) < rate * 2**32


def tool_demonstration(task: dict, grammar, gym, tokenizer, image_dir: Path | None,
                       answer_with: str = "letter") -> dict:
    """Zoom into the gold box (then retrieve_knowledge for the finding when allowed), through the real tool actors."""
    gym.reset(task)
    calls = [("The finding may be small: inspect it at full resolution.",
              {"name": "zoom_in", "arguments": {"box": [int(v) for v in task["gold_boxes"][0]]}})]
    if "retrieve_knowledge" in gym.env.allowed:
        calls.append(("What does this finding indicate?",
                      {"name": "retrieve_knowledge", "arguments": {"query": expert_query(task)}}))
    segments = []
    for turn, (thought, call) in enumerate(calls):
        policy = f"<think>{thought}</think>\n<{grammar.action_tag}>{json.dumps(call)}</{grammar.action_tag}>"
        observation, done, info = gym.step(policy)
        if info["record"].get("error") is not None or done:
            raise RuntimeError(f"task {task['id']}: the expert's {call['name']} call failed: {observation.text}")
        if observation.images:  # shown to the policy as the runner shows them: image placeholders, then the text
            layout = image_layout(tokenizer.name_or_path)
            if layout is None:
                raise ValueError(f"task {task['id']}: {call['name']} shows images but the policy "
                                 f"{tokenizer.name_or_path} is text-only")
            body = layout.placeholder * len(observation.images) + observation.text
            segment = {"role": "environment", "text": grammar.wrap_observation(body)}
        else:
            segment = {"role": "environment", "text": cut_observation(grammar, observation.text, tokenizer)}
        if observation.images and image_dir is not None:
            image_dir.mkdir(parents=True, exist_ok=True)
            segment["images"] = []
            for k, image in enumerate(observation.images):
                path = image_dir / f"{task['id']}-{turn}-{k}.png"
                image.save(path)
                segment["images"].append(str(path.resolve()))
        segments += [{"role": "policy", "text": policy}, segment]
    return {"task": task, "segments": segments + [answer_segment(task, grammar, "The close-up shows the finding.",
                                                                  answer_with)]}


def write_demonstrations(cfg, data: str, out: Path, limit: int | None = None, progress: bool = True,
                         answer_with: str = "letter", recheck: float = 0.0, unlinked: str = "ranking") -> dict:
    """Demonstrations for the tasks of `data` under run config `cfg` (its grammar, environment, tokenizer);
    multiple-choice answers as the option's letter or (`answer_with="text"`) its text. `recheck`: the share of
    retrieval demonstrations in which the expert reads the next page of results before it answers (`rechecks`);
    `unlinked`: what it does when no hit shows the gold option (retrieval_demonstration)."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from learners.data import load_tasks
    from tasks.tiny_models import policy_dir

    grammar = cfg.rollout.grammar
    tokenizer = AutoTokenizer.from_pretrained(policy_dir(cfg.model))
    tasks = load_tasks(data)[:limit]
    index_dir = None
    if grammar.action_tag and cfg.retrieval is not None:
        from learners.services import ensure_run_index
        index_dir = ensure_run_index(cfg)
    demos, skipped = [], 0
    if grammar.action_tag and cfg.tools is not None:
        demos = tool_demonstrations(cfg, tasks, tokenizer, index_dir, out.with_name(out.name + ".images"), progress,
                                    answer_with)
    elif grammar.action_tag:
        from actors.retriever import LocalRetriever
        from learners.services import retrieval_environment
        environment = retrieval_environment(cfg, LocalRetriever(index_dir, config=cfg.retrieval.search))
        for start in tqdm(range(0, len(tasks), 64), desc="demonstrations", disable=not progress):
            chunk = tasks[start:start + 64]
            results = environment.retriever.search([expert_query(t) for t in chunk], 2 * environment.top_k,
                                                   [environment.among(t.get("options")) for t in chunk])
            for task, result in zip(chunk, results):
                demo = retrieval_demonstration(task, grammar, environment, result, tokenizer, answer_with,
                                               next_page=bool(recheck and rechecks(task, recheck)),
                                               unlinked=unlinked)
                skipped += demo is None
                demos += [demo] if demo else []
    else:
        demos = [{"task": t, "segments": [answer_segment(
            t, grammar, "Match the findings to an option." if t.get("options") else "Name what fits the findings.",
            answer_with)]} for t in tasks]
    out.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(out, demos)
    return {"tasks": len(tasks), "demonstrations": len(demos), "skipped_not_retrieved": skipped, "out": str(out)}


def tool_demonstrations(cfg, tasks: list[dict], tokenizer, index_dir: Path | None, image_dir: Path,
                        progress: bool, answer_with: str = "letter") -> list[dict]:
    """Tool episodes on the run's tool actors (a private local Ray unless RAY_ADDRESS names one)."""
    import ray
    from tqdm import tqdm

    from actors.gym import MedicalGym, make_tool_environment
    from cluster.ray_session import start_or_join

    started = not ray.is_initialized()
    if started:
        start_or_join(cfg.cluster)
    retriever = None
    if index_dir is not None:
        from actors.retriever import ShardedRetriever
        # named shards travel to the tool actors by name, so Ray can rebuild a restarted one
        retriever = ShardedRetriever(index_dir, config=cfg.retrieval.search, actor_options=lambda i: {
            "num_cpus": 0, "name": f"Retriever-expert-{os.getpid()}-{i}"})
    env = make_tool_environment(cfg.tools, retriever=retriever)
    try:
        gym = MedicalGym(env, cfg.rollout.grammar)
        return [tool_demonstration(t, cfg.rollout.grammar, gym, tokenizer, image_dir, answer_with)
                for t in tqdm(tasks, desc="demonstrations", disable=not progress)]
    finally:
        for actor in env.actors() + (retriever.actors if retriever else []):
            ray.kill(actor)
        if started:
            ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    from learners.config import ConfigError, load_config

    parser = argparse.ArgumentParser(prog="python -m learners.expert", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="run config whose grammar, environment and model to follow")
    parser.add_argument("--data", required=True, help="tasks: JSONL or <world>:<split> (e.g. hpo:mcq_train)")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--answer-with", choices=["letter", "text"], default="letter",
                        help="multiple choice: answer with the option letter or the option text")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the run config")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # the demonstrations the config's cold start trains on: its first `sft.data: expert` stage's expert settings
    sft = next((s.sft for s in cfg.stage_plan() if s.sft and s.sft.data == "expert"), None)
    print(json.dumps(write_demonstrations(cfg, args.data, args.out, args.limit, answer_with=args.answer_with,
                                          recheck=sft.expert_recheck if sft else 0.0,
                                          unlinked=sft.expert_unlinked if sft else "ranking")))
    return 0


if __name__ == "__main__":
    sys.exit(main())

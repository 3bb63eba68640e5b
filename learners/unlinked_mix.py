"""Training tasks weighted toward the questions whose first search links no option: where a policy can do better than
the scripted expert, which answers from what its search links (learners/expert.py).

    python -m learners.unlinked_mix --config configs/quickstart.yaml --data hpo:mcq_train --out mix.jsonl \
        [--share 0.5] [key=value ...]

The run config's retrieval (its index, search mode and page size `retrieval.search.top_k`) searches each task with the
expert's query; every task whose first page links none of its options is kept, and enough of the linked ones are drawn
(seeded) that the unlinked make `--share` of the file. An RL stage trains on it with `set: {data.train: mix.jsonl}`,
so its groups meet the questions imitation leaves to a guess as often as the ones it already answers.
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def unlinked_mix(tasks: list[dict], linked: list[bool], share: float, seed: int = 0) -> list[dict]:
    """Every task with `linked` False, plus linked tasks drawn without replacement so that the unlinked are `share`
    of the result (as many as exist when fewer are needed), shuffled with `seed`."""
    if not 0 < share <= 1:
        raise ValueError(f"--share {share}: the unlinked tasks' share must be in (0, 1]")
    unlinked = [t for t, link in zip(tasks, linked) if not link]
    rest = [t for t, link in zip(tasks, linked) if link]
    rng = random.Random(seed)
    mix = unlinked + rng.sample(rest, min(len(rest), round(len(unlinked) * (1 - share) / share)))
    rng.shuffle(mix)
    return mix


def first_page_links(cfg, tasks: list[dict]) -> list[bool]:
    """Whether the expert's query (learners.expert.expert_query) links one of each task's options on the first page
    of the run's search."""
    from actors.retrieval_env import first_linked
    from actors.retriever import LocalRetriever
    from learners.expert import expert_query
    from learners.services import ensure_run_index

    page = cfg.retrieval.search.top_k
    retriever = LocalRetriever(ensure_run_index(cfg), config=cfg.retrieval.search)
    hits = retriever.search([expert_query(t) for t in tasks], page, [list(t["options"].values()) for t in tasks])
    return [first_linked(found, t["options"]) is not None for t, found in zip(tasks, hits)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m learners.unlinked_mix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--data", required=True, help="the task set to draw from (data.train's forms)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--share", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides (the run's retrieval settings)")
    args = parser.parse_args(argv)

    from cluster.files import write_jsonl
    from learners.config import load_config
    from learners.data import load_tasks

    cfg = load_config(args.config, args.overrides)
    tasks = [t for t in load_tasks(args.data) if t.get("options")]
    linked = first_page_links(cfg, tasks)
    n = write_jsonl(args.out, unlinked_mix(tasks, linked, args.share, args.seed))
    print(f"{args.out}: {n} tasks, {linked.count(False)} of {len(tasks)} unlinked on the first page "
          f"({args.share:.0%} of the file)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

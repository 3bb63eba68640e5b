"""Where the expert's search first links a multiple-choice option, page by page: the headroom of search behaviour.

    python benchmarks/bench_link_depth.py [--limit 500] [--depth 50] [--data SET ...] [--modes sparse phenotype]
                                          [key=value ...]

For the first --limit questions of each task set (default hpo:mcq_test and hpo:mcq_train), the quickstart's retrieval
(the HPO knowledge base, retrieval.show=titles, link_options) in each search mode (BM25, phenotype similarity) searched
with the scripted expert's query (the case's phenotypes) down to --depth hits, in pages of retrieval.search.top_k: how
many questions link an option on page 1 (and whether it is the gold one), how many link one first on page 2, 3, ...
(gold or not), and how many link none in the whole depth. A policy that answers page 1's first linked option and
otherwise guesses scores (page1_gold + unlinked / 4) / n; one that pages on (retrieval.paging) while nothing is linked
and answers the first link it sees scores (page1_gold + later pages' gold + none / 4) / n. With the options ranked
(retrieval.rank_options: the same search among the options' titles, however deep), one that answers page 1's first
link, else the ranking's first option, else guesses scores (page1_gold + ranked_gold + unranked / 4) / n. Writes
benchmarks/results/link_depth.json and prints a table.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def first_links(tasks: list[dict], hits: list[list[dict]], page: int) -> dict[str, int]:
    """Counts by where the first linked option lies: `page<n>_gold`, `page<n>_wrong`, or `none`; and of the
    questions page 1 links none, where the options' ranking (the hits marked `candidate`) puts the gold first
    (`ranked_gold`), another option (`ranked_wrong`), or ranks none (`unranked`)."""
    from actors.retrieval_env import first_linked, linked_option
    counts: dict[str, int] = {}
    for task, found in zip(tasks, hits):
        first = first_linked(found, task["options"])
        keys = ["none" if first is None else
                f"page{first[0] // page + 1}_{'gold' if first[1] == task['answer'] else 'wrong'}"]
        if first is None or first[0] >= page:
            ranked = [letter for h in found if h.get("candidate") and (letter := linked_option(h, task["options"]))]
            keys.append("unranked" if not ranked else "ranked_gold" if ranked[0] == task["answer"] else "ranked_wrong")
        for key in keys:
            counts[key] = counts.get(key, 0) + 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=int, default=500)
    parser.add_argument("--depth", type=int, default=50)
    parser.add_argument("--data", nargs="+", default=["hpo:mcq_test", "hpo:mcq_train"])
    parser.add_argument("--modes", nargs="+", default=["sparse", "phenotype"])
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from actors.retriever import LocalRetriever
    from benchmarks.common import report
    from learners.config import load_config
    from learners.data import load_tasks
    from learners.expert import expert_query
    from learners.services import ensure_run_index

    cfg = load_config("configs/quickstart.yaml", args.overrides)
    index, page = ensure_run_index(cfg), cfg.retrieval.search.top_k
    rows = []
    for split, mode in ((split, mode) for split in args.data for mode in args.modes):
        retriever = LocalRetriever(index, config=cfg.retrieval.search.model_copy(update={"mode": mode}))
        tasks = load_tasks(split)[:args.limit]
        found = retriever.search([expert_query(t) for t in tasks], args.depth, [list(t["options"].values())
                                                                               for t in tasks])
        counts = first_links(tasks, found, page)
        pages = sorted({k.split("_")[0] for k in counts if k.startswith("page")})
        later_gold = sum(v for k, v in counts.items() if k.startswith("page") and k.endswith("_gold")
                         and not k.startswith("page1_"))
        unlinked = len(tasks) - counts.get("page1_gold", 0) - counts.get("page1_wrong", 0)
        rows.append({"split": split, "mode": mode, "n": len(tasks), "page_size": page, **dict(sorted(counts.items())),
                     "first_page_policy_accuracy": (counts.get("page1_gold", 0) + unlinked / 4) / len(tasks),
                     "paging_policy_accuracy": (counts.get("page1_gold", 0) + later_gold
                                                + counts.get("none", 0) / 4) / len(tasks),
                     "ranking_policy_accuracy": (counts.get("page1_gold", 0) + counts.get("ranked_gold", 0)
                                                 + counts.get("unranked", 0) / 4) / len(tasks),
                     "pages_with_links": len(pages)})
    report("link_depth", rows)


if __name__ == "__main__":
    main()

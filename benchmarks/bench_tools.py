"""Tool latency and batched throughput: each tool of actors.tools on its ToolActor, over imaging-world images.

    python benchmarks/bench_tools.py [--calls 32] [--batches 1,8,32] [--tools zoom_in,enhance,...]
    python benchmarks/bench_tools.py --tools segment,super_resolve --batches 1,8   # re-time some tools only

Per tool: end-to-end latency of one call (driver -> actor -> result, Ray included; median and p90 of sequential
calls), throughput of batches of B calls (one run_batch each), and the time inside the tool per call (the actor's
own counter). Also the region finder's recall on the world's images: share of images where one of its top-5 boxes
overlaps the target lesion's gold box (IoU > 0.1), per modality and size. retrieve_knowledge searches a BM25 index of
a slice of the HPO knowledge base (the first 2,000 chunks); biomedclip_labels, segment (SAM) and super_resolve
(Swin2SR x2) run their tiny random builds, on the CPU. Writes benchmarks/results/tools.json; the rows of tools not
named in --tools are kept from the file's previous run (each row says when it was measured).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOOLS = ["zoom_in", "enhance", "find_regions", "biomedclip_labels", "retrieve_knowledge", "segment", "super_resolve"]


def arguments_for(tool: str, task: dict, i: int) -> dict:
    """A realistic call of `tool` on `task`: around its gold box, varied by i so no two calls are the same."""
    x0, y0, x1, y1 = (int(v) for v in task["gold_boxes"][0])
    pad = 8 + i % 16
    box = [max(0, x0 - pad), max(0, y0 - pad), min(448, x1 + pad), min(448, y1 + pad)]
    return {"zoom_in": {"box": box},
            "enhance": {"method": ("clahe", "denoise", "brighten")[i % 3], "box": box},
            "find_regions": {"max_regions": 5},
            "biomedclip_labels": {"labels": list(task["options"].values()), "box": box},
            "retrieve_knowledge": {"query": f"{task['metadata']['hpo_name']} {task['metadata']['region']}"},
            "segment": {"box": box},
            "super_resolve": {"box": box}}[tool]


def kept_rows(path: Path, measured: list[str]) -> list[dict]:
    """The previous run's rows of the tools this run does not measure, stamped with that run's time, so timing a few
    tools does not wipe the others' numbers."""
    if not path.is_file():
        return []
    previous = json.loads(path.read_text())
    return [{**row, "measured": row.get("measured", previous["when"])} for row in previous["rows"]
            if row["tool"] not in measured]


def region_finder_recall(tasks: list[dict]) -> list[dict]:
    from actors.tools import ToolCall, ToolContext, box_iou, make_tool

    tool = make_tool("find_regions")
    hits: dict[tuple[str, str], list[bool]] = {}
    for task in tasks:
        context = ToolContext.from_task(task)
        boxes = tool.run_batch([ToolCall(tool.validate({"max_regions": 5}, context), context)])[0].boxes
        key = (task["metadata"]["modality"], task["metadata"]["size_stratum"])
        hits.setdefault(key, []).append(any(box_iou(b, task["gold_boxes"][0]) > 0.1 for b in boxes))
    return [{"modality": m, "stratum": s, "images": len(v), "recall_at_5": float(np.mean(v))}
            for (m, s), v in sorted(hits.items())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=32, help="calls per measurement")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--recall-images", type=int, default=120)
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batches.split(",")]

    import ray

    from indexing.build_index import build_index
    from actors.gym import ToolActorConfig, ToolsConfig, start_tool_actors
    from indexing.retrieval_index import IndexConfig, resolve_corpus
    from actors.retriever import Retriever
    from actors.tools import ToolCall, ToolContext, tool_class
    from benchmarks.common import report
    from cluster.ray_session import start_or_join
    from cluster.config import ClusterConfig
    from tasks.build_imaging import ensure_imaging_world
    from tasks.schema import read_tasks, resolve_image_paths

    world = ensure_imaging_world(progress=False)
    path = world["finding_mcq_train"]
    tasks = [resolve_image_paths(t, path.parent).model_dump(mode="json") for t in read_tasks(path)]

    os.environ.pop("RAY_ADDRESS", None)
    start_or_join(ClusterConfig(num_cpus=2))
    try:
        tools = args.tools.split(",")
        retriever = None
        if "retrieve_knowledge" in tools:
            out = Path(os.environ.get("TMPDIR", "/tmp")) / "medray_bench_tools_kb"
            out.mkdir(parents=True, exist_ok=True)
            with open(resolve_corpus("hpo"), encoding="utf-8") as fh:
                (out / "chunks.jsonl").write_text("".join(line for _, line in zip(range(2000), fh)), encoding="utf-8")
            build_index(out / "chunks.jsonl", out / "index", config=IndexConfig(kind="none"), progress=False)
            retriever = Retriever.options(num_cpus=0.25).remote(str(out / "index"),
                                                                 config={"mode": "sparse", "top_k": 3})
        config = ToolsConfig(tools={t: ToolActorConfig(num_cpus=0.25) for t in tools})
        actors = start_tool_actors(config, retriever)
        out_path = Path("benchmarks/results/tools.json")
        rows = kept_rows(out_path, tools)
        now = time.strftime("%Y-%m-%d %H:%M:%S")
        for tool in tools:
            actor, cls = actors[tool][0], tool_class(tool)
            calls = []
            for i in range(max(args.calls, max(batch_sizes))):
                task = tasks[i % len(tasks)]
                context = ToolContext.from_task(task)
                calls.append(ToolCall(cls.validate(arguments_for(tool, task, i), context), context))
            ray.get(actor.run_batch.remote(calls))  # warm: models loaded, every image cached
            latencies = []
            for call in calls[:args.calls]:
                started = time.perf_counter()
                result = ray.get(actor.run_batch.remote([call]))[0]
                latencies.append(time.perf_counter() - started)
                assert result.error is None, result.error
            for batch in batch_sizes:
                before = ray.get(actor.stats.remote())
                n_batches = max(1, args.calls // batch)
                started = time.perf_counter()
                ray.get([actor.run_batch.remote(calls[:batch]) for _ in range(n_batches)])
                seconds = time.perf_counter() - started
                after = ray.get(actor.stats.remote())
                inside = (after["seconds"] - before["seconds"]) / (after["calls"] - before["calls"])
                rows.append({"tool": tool, "batch": batch, "calls_per_s": n_batches * batch / seconds,
                             "latency_ms_p50": 1e3 * float(np.median(latencies)) if batch == 1 else "",
                             "latency_ms_p90": 1e3 * float(np.percentile(latencies, 90)) if batch == 1 else "",
                             "tool_ms_per_call": 1e3 * inside, "measured": now})
        rows.sort(key=lambda r: (TOOLS.index(r["tool"]), r["batch"]))
        out_path = report("tools", rows)
        recall = region_finder_recall(tasks[:args.recall_images])
        print("\nfind_regions recall@5 (IoU > 0.1 with the target's gold box):")
        for r in recall:
            print(f"  {r['modality']:<11} {r['stratum']:<6} {r['recall_at_5']:.2f} of {r['images']}")
        data = json.loads(out_path.read_text())
        data["find_regions_recall"] = recall
        data["settings"] = {"calls": args.calls, "batches": batch_sizes, "cpus": os.cpu_count(),
                            "retriever": "BM25 (sparse) over the first 2000 HPO KB chunks",
                            "models": "tiny random builds: biomedclip, sam (256 px), swin2sr (x2)",
                            "images": "each call of a batch on another image (no shared SAM image encoding)"}
        out_path.write_text(json.dumps(data, indent=1))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()

"""A GRPO run spread over a simulated three-node Ray cluster (`ray.cluster_utils.Cluster`: one raylet and object
store per node on this host, the way Ray tests itself). Each role is pinned to its own node by a custom resource:
the head holds the reward actor and the retriever, node 1 the vLLM rollout worker, node 2 both DeepSpeed ranks, so
weights travel between raylets at every sync. Run as a script (it owns its Ray cluster):

    python tests/clusters/three_nodes.py OUT_DIR [--one-node] [dotted.key=value ...]

`--one-node` gives the head every custom resource (the same run on one raylet, for comparison). Writes
OUT_DIR/report.json: each actor's node, and the run's metrics.
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from learners.config import load_config  # noqa: E402
from learners.trainer import Trainer  # noqa: E402

NODES = {"head": {"node_services": 4}, "rollout": {"node_rollout": 1}, "learner": {"node_learner": 2}}
PINNED = ["cluster.reward.resources={node_services: 1}", "cluster.retriever.resources={node_services: 1}",
          "cluster.rollout.resources={node_rollout: 1}", "cluster.learner.resources={node_learner: 1}"]


def _node_id(actor) -> str:
    return ray.get_runtime_context().get_node_id()


def main(out: Path, one_node: bool, overrides: list[str]) -> None:
    os.environ.pop("RAY_ADDRESS", None)
    store = 1500 << 20  # room for a real model's weights in flight
    head = {k: v for resources in NODES.values() for k, v in resources.items()} if one_node else NODES["head"]
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 3 if one_node else 1, "resources": head, "object_store_memory": store, "include_dashboard": False})
    for role in () if one_node else ("rollout", "learner"):
        cluster.add_node(num_cpus=1, resources=NODES[role], object_store_memory=store)
    cluster.wait_for_nodes()
    cfg = load_config("configs/tiny.yaml", [
        f"cluster.address={cluster.address}", *PINNED, "total_steps=2", "rollout.prompts_per_step=4",
        "rollout.group_size=4", "rollout.max_new_tokens=16", "rollout.fidelity_check_every=1", "checkpoint.every=10",
        "learner.micro_batch_size=4", "logging.progress_bar=false", f"output_dir={out / 'run'}", *overrides])
    trainer = Trainer(cfg)
    trainer.setup()
    node_of_resource = {n["NodeID"]: next((k for k in n["Resources"] if k.startswith("node_")), None)
                        for n in ray.nodes() if n["Alive"]}
    roles = {"rollout": trainer.workers, "learner": trainer.learners.ranks, "reward": trainer.rewarders,
             "retriever": trainer.environment.actors()}
    actors = {f"{role}-{i}": node_of_resource[ray.get(actor.__ray_call__.remote(_node_id))]
              for role, handles in roles.items() for i, actor in enumerate(handles)}
    try:
        trainer.loop()
    finally:
        trainer.shutdown()
    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    (out / "report.json").write_text(json.dumps({"actors": actors, "metrics": metrics}))
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), "--one-node" in sys.argv[2:], [a for a in sys.argv[2:] if a != "--one-node"])

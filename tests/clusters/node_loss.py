"""Whole nodes lost in the middle of a GRPO run on a simulated Ray cluster (`ray.cluster_utils.Cluster`), the way
`cluster.remove_node` takes a machine away: its raylet, object store and every worker process on it die at once.

    python tests/clusters/node_loss.py OUT_DIR NODE [NODE ...]      (NODE: rollout or learner)

The head holds the reward actor and the retriever, node `rollout` the vLLM rollout worker, node `learner` both
DeepSpeed ranks (as in three_nodes.py), and a spare node can take every role. The k-th node named is removed when
metrics.jsonl shows step k, and the run lasts two steps more than nodes are named:

* `rollout`: Ray moves the worker's placement-group bundle to the spare node and restarts the worker there; the run
  goes on, generating the lost share again under the current weights.
* `learner`: the learner group stops with LearnerRankFailed; Ray moves its placement-group bundles to the spare node,
  where the trainer starts a new group from the last checkpoint on the run's storage (`storage.path`, a file:// URI)
  and goes on.

Writes OUT_DIR/report.json: each actor's node before and after, the error, and the run's metrics.
"""
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from learners.config import load_config  # noqa: E402
from learners.learner_group import LearnerRankFailed  # noqa: E402
from learners.trainer import Trainer  # noqa: E402
from three_nodes import PINNED, _node_id  # noqa: E402

NODES = {"head": {"node_services": 4}, "rollout": {"node_rollout": 1}, "learner": {"node_learner": 2},
         "spare": {"node_rollout": 1, "node_learner": 2}}
ROLES = ("rollout", "learner")


def placed(trainer: Trainer, names: dict[str, str]) -> dict[str, str]:
    """Which node (by name) each rollout worker, learner rank, reward actor and retriever is on now."""
    roles = {"rollout": trainer.workers, "learner": trainer.learners.ranks, "reward": trainer.rewarders,
             "retriever": trainer.environment.actors()}
    return {f"{role}-{i}": names[ray.get(actor.__ray_call__.remote(_node_id), timeout=300)]
            for role, handles in roles.items() for i, actor in enumerate(handles)}


def remove_after_step(cluster: Cluster, node, metrics: Path, step: int, removed: list) -> threading.Thread:
    """Remove `node` (no graceful drain: a machine lost) once `metrics` shows step `step`."""
    def watch():
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= step):
            time.sleep(0.2)
        cluster.remove_node(node, allow_graceful=False)
        removed.append(time.time())
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def main(out: Path, lose: list[str]) -> None:
    os.environ.pop("RAY_ADDRESS", None)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": NODES["head"], "include_dashboard": False})
    nodes = {role: cluster.add_node(num_cpus=1, resources=NODES[role]) for role in ROLES}
    cluster.wait_for_nodes()
    # the spare joins once the run is placed, so the roles start on their own nodes
    overrides = [f"cluster.address={cluster.address}", *PINNED, f"total_steps={len(lose) + 2}", "rollout.prompts_per_step=4",
                 "rollout.group_size=4", "rollout.max_new_tokens=16", "rollout.fidelity_check_every=1",
                 "checkpoint.every=1", "learner.micro_batch_size=4", "logging.progress_bar=false",
                 f"output_dir={out / 'run'}", f"storage.path=file://{out / 'store'}"]
    trainer = Trainer(load_config("configs/tiny.yaml", overrides))
    trainer.setup()
    nodes["spare"] = cluster.add_node(num_cpus=len(ROLES) + 1, resources=NODES["spare"])
    cluster.wait_for_nodes()
    names = {node.node_id: role for role, node in nodes.items()}
    names[cluster.head_node.node_id] = "head"
    report = {"before": placed(trainer, names), "error": None}
    removed: list = []
    watchers = [remove_after_step(cluster, nodes[role], out / "run" / "metrics.jsonl", step, removed)
                for step, role in enumerate(lose, start=1)]
    try:
        trainer.loop()
        report["after"] = placed(trainer, names)
    except LearnerRankFailed as e:
        report["error"] = str(e)
    finally:
        trainer.shutdown()
    for watcher in watchers:
        watcher.join(timeout=60)
    report["removed"] = len(removed)
    report["metrics"] = [json.loads(line) for line in (out / "store" / "metrics.jsonl").read_text().splitlines()]
    committed = (out / "store" / "checkpoints").glob("step_*/manifest.json")
    report["stored_checkpoints"] = sorted(manifest.parent.name for manifest in committed)
    (out / "report.json").write_text(json.dumps(report))
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    if len(sys.argv) < 3 or not set(sys.argv[2:]) <= set(ROLES):
        sys.exit(__doc__)
    main(Path(sys.argv[1]), sys.argv[2:])

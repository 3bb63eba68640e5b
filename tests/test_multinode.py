"""Multi-node, proven on one machine: a GRPO run whose roles sit on three different raylets of a simulated Ray
cluster (tests/clusters/node_loss.py), so every weight sync crosses object stores and is checked for fidelity, while
the rollout worker's node and then the learners' node are lost."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.multinode]


def test_roles_on_three_nodes_sync_across_raylets_and_survive_losing_the_rollout_then_the_learner_node(tmp_path):
    """The rollout worker's node is removed during step 2: Ray moves its bundle to the spare node and restarts it
    there, and the lost share is generated again under the current weights. Both learner ranks' node is removed
    during step 3: the group stops with LearnerRankFailed, Ray moves its bundles to the spare node, and the trainer
    starts a new group there from the checkpoint on the run's storage and redoes the steps since. A new group placed
    before Ray has declared the node dead is lost with it: that attempt counts as a second restart. The run
    completes its 4 steps, each logged once, every sync faithful."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "clusters" / "node_loss.py"), str(tmp_path),
                           "rollout", "learner"], cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["removed"] == 2 and report["error"] is None
    assert report["before"] == {"rollout-0": "rollout", "learner-0": "learner", "learner-1": "learner",
                                "reward-0": "head", "retriever-0": "head"}
    assert report["after"] == {**report["before"], "rollout-0": "spare", "learner-0": "spare", "learner-1": "spare"}
    metrics = report["metrics"]  # as published to storage
    assert [m["step"] for m in metrics] == [1, 2, 3, 4] and [m["weight_version"] for m in metrics] == [1, 2, 3, 4]
    assert metrics[-1]["actor_restarts/rollout"] >= 1 and metrics[-1]["actor_restarts/learner"] in (1, 2)
    assert report["stored_checkpoints"][-1] == "step_4"
    # the engine, moved and restarted, scores like the learners, moved and restarted, after every cross-node sync
    assert all(m["fidelity_max_abs_diff"] <= 1e-4 for m in metrics)

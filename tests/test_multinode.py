"""Multi-node, proven on one machine: a GRPO run whose roles sit on three different raylets of a simulated Ray
cluster (tests/clusters/three_nodes.py), so every weight sync crosses object stores and is checked for fidelity."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.multinode]


def test_roles_on_three_nodes_train_and_sync_across_raylets(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "clusters" / "three_nodes.py"), str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["actors"] == {"rollout-0": "node_rollout", "learner-0": "node_learner", "learner-1": "node_learner",
                                "reward-0": "node_services", "retriever-0": "node_services"}
    metrics = report["metrics"]
    assert [m["step"] for m in metrics] == [1, 2]
    assert [m["weight_version"] for m in metrics] == [1, 2]
    # the engine on node_rollout scores like the learner on node_learner after every cross-node sync
    assert all(m["fidelity_max_abs_diff"] <= 1e-4 for m in metrics)

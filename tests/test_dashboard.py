"""The Ray dashboard of a live run, as a user opens it: `medray train` with `cluster.include_dashboard=true` (token
auth on, as on a cluster), asked through the dashboard's own HTTP API on loopback for the run's actors and placement
groups (the state API) and for its training gauges (the Prometheus targets the dashboard's Metrics view scrapes)."""
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
#: A tiny run that trains a step in seconds; the test ends it once it has seen what it asks for.
RUN = ["total_steps=1000", "cluster.include_dashboard=true", "rollout.prompts_per_step=4", "rollout.group_size=4",
       "rollout.max_new_tokens=16", "learner.micro_batch_size=4", "rollout.fidelity_check_every=0",
       "checkpoint.every=1000", "logging.progress_bar=false"]
ACTORS = {"RolloutWorker-0": "rollout", "LearnerWorker-0": "learner", "LearnerWorker-1": "learner",
          "RewardActor-0": "reward", "Retriever-0": "retriever"}
#: gauge -> the metrics.jsonl name it shows
GAUGES = {"ray_medray_reward_mean": "reward_mean", "ray_medray_reward_accuracy": "accuracy",
          "ray_medray_actor_kl": "kl", "ray_medray_timing_train_s": "train_s",
          "ray_medray_weights_weight_version": "weight_version"}
SAMPLE = re.compile(r"^(ray_medray_\w+)\{([^}]*)\} (\S+)$")


def wait_for(what: str, check, process: subprocess.Popen, console: Path, timeout_s: float = 600.0):
    """Poll `check` until it returns something truthy; fail naming `what` (with the run's last lines) on timeout or
    when the run has ended."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        found = check()
        if found:
            return found
        time.sleep(2)
    tail = "\n".join(console.read_text(errors="replace").splitlines()[-30:])
    pytest.fail(f"{what}: not seen (run {'ended' if process.poll() is not None else 'still running'})\n{tail}")


@pytest.fixture
def live_run(tmp_path):
    out, console = tmp_path / "run", tmp_path / "console.log"
    token = secrets.token_hex(32)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    env.pop("RAY_ADDRESS", None)
    with open(console, "w") as sink:
        process = subprocess.Popen([sys.executable, "-m", "learners.cli", "train", "--config", "configs/tiny.yaml",
                                    f"output_dir={out}", *RUN], cwd=ROOT, env=env, stdout=sink,
                                   stderr=subprocess.STDOUT)
    try:
        def announced():
            log = out / "run.log"
            match = re.search(r"ray dashboard: (http://\S+)", log.read_text()) if log.exists() else None
            return match and match.group(1)
        url = wait_for("the dashboard's address in run.log", announced, process, console)
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as dashboard:
            yield {"process": process, "out": out, "console": console, "url": url, "dashboard": dashboard}
    finally:
        if process.poll() is None:  # the test failed before it ended the run
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def state(dashboard: httpx.Client, resource: str) -> list[dict]:
    """One listing of the dashboard's state API (/api/v0/<resource>), with details."""
    reply = dashboard.get(f"/api/v0/{resource}", params={"limit": 1000, "detail": 1})
    reply.raise_for_status()
    return reply.json()["data"]["result"]["result"]


def gauges(dashboard: httpx.Client, session: str) -> dict[str, float]:
    """The medray gauges of Ray session `session` on every Prometheus target the dashboard lists (the machine's other
    Ray sessions may be listed too; a target that no longer answers is skipped)."""
    found = {}
    for group in dashboard.get("/api/prometheus/sd").json():
        for target in group["targets"]:
            try:
                text = httpx.get(f"http://{target}/metrics", timeout=10).text
            except httpx.HTTPError:
                continue
            for line in text.splitlines():
                sample = SAMPLE.match(line)
                if sample and f'SessionName="{session}"' in sample.group(2):
                    found[sample.group(1)] = float(sample.group(3))
    return found


def test_the_dashboard_shows_every_role_by_name_and_the_training_gauges(live_run):
    process, out, console, dashboard = (live_run[k] for k in ("process", "out", "console", "dashboard"))
    assert httpx.get(f"{live_run['url']}/api/v0/actors").status_code == 401, "the dashboard wants the token"

    def training():
        path = out / "metrics.jsonl"
        return path.exists() and len(path.read_text().splitlines()) >= 2
    wait_for("two training steps in metrics.jsonl", training, process, console)

    actors = {a["name"]: a for a in state(dashboard, "actors") if a["state"] == "ALIVE"}
    assert set(ACTORS) <= set(actors), f"alive actors: {sorted(actors)}"
    groups = {g["name"]: g for g in state(dashboard, "placement_groups")}
    assert set(groups) == {f"medray-{role}" for role in ACTORS.values()}
    assert all(g["state"] == "CREATED" for g in groups.values())
    assert len(groups["medray-learner"]["bundles"]) == 2
    for name, role in ACTORS.items():  # each actor runs in its role's reservation
        assert actors[name]["placement_group_id"] == groups[f"medray-{role}"]["placement_group_id"], name

    session = dashboard.get("/api/version").json()["session_name"]

    def exported():
        shown = gauges(dashboard, session)
        return shown if set(GAUGES) <= set(shown) else None
    shown = wait_for("the training gauges on the dashboard's Prometheus targets", exported, process, console,
                     timeout_s=180)
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for gauge, key in GAUGES.items():  # each gauge shows the value of a step the run logged
        assert any(shown[gauge] == pytest.approx(record[key]) for record in logged), (gauge, shown[gauge])
    assert shown["ray_medray_weights_weight_version"] >= 1

    # Stopping the run (what `kill` or a scheduler sends) takes its Ray, and so its dashboard, with it.
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=120)

    def gone():
        try:
            return dashboard.get("/api/version").json().get("session_name") != session
        except httpx.HTTPError:
            return True
    deadline = time.monotonic() + 60
    while not gone():
        assert time.monotonic() < deadline, "the run's dashboard still answers after the run ended"
        time.sleep(2)

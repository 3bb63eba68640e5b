"""Beyond one process: ray_cluster.yaml passes Ray's own cluster-config validation, and `ray job submit` runs the
quickstart on a head started with `ray start --head` on loopback (token auth on), reaching SUCCEEDED with its
metrics and checkpoints written."""
import copy
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_YAML = ROOT / "ray_cluster.yaml"
LOCAL_VARIANT_MARKER = "# >>> the local variant"


def validated(config: dict) -> dict:
    """What `ray up` does to a config before it talks to any cloud: fill in defaults, then check the schema."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def local_variant(text: str) -> dict:
    """The commented `provider: local` block of ray_cluster.yaml, in place of the cloud-specific keys."""
    block = text.split(LOCAL_VARIANT_MARKER, 1)[1].split("\n", 1)[1]
    variant = yaml.safe_load("\n".join(line[2:] for line in block.splitlines() if line.startswith("# ")))
    cloud_keys = ("max_workers", "provider", "auth", "available_node_types", "head_node_type")
    return {**{k: v for k, v in yaml.safe_load(text).items() if k not in cloud_keys}, **variant}


def test_cluster_yaml_passes_rays_validation():
    config = yaml.safe_load(CLUSTER_YAML.read_text())
    prepared = validated(config)
    types = prepared["available_node_types"]
    assert prepared["max_workers"] >= 1 and all(t["max_workers"] >= t.get("min_workers", 0) for t in types.values())
    assert any("gpu" in name for name in types)
    assert any('pip install -q -e ".[gpu]"' in command for command in prepared["setup_commands"])
    assert "/home/ubuntu/medray" in prepared["file_mounts"]
    start = " ".join(prepared["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in start and "RAY_AUTH_MODE=token" in start
    # The launcher adds SSH-from-anywhere only to security groups it creates: every node names its own group.
    assert all(t["node_config"].get("SecurityGroupIds") for t in types.values())


def test_local_variant_passes_rays_validation():
    prepared = validated(local_variant(CLUSTER_YAML.read_text()))
    assert prepared["provider"]["type"] == "local"


def test_validation_catches_a_misspelt_key():
    config = yaml.safe_load(CLUSTER_YAML.read_text())
    config["setup_comands"] = config.pop("setup_commands")
    with pytest.raises(Exception, match="setup_comands"):
        validated(config)


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def cluster_processes(temp_dir: str) -> list[psutil.Process]:
    """Every live process of the cluster whose files live in `temp_dir` (its daemons name it on their command line)
    and their descendants (workers, job drivers) -- so the test stops its own cluster and nobody else's (`ray stop`
    would stop every Ray on the machine). A zombie has exited and holds nothing; reaping it is its parent's (often
    the machine's init), so it does not count."""
    roots = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(temp_dir in arg for arg in proc.info["cmdline"] or []):
            roots.append(proc)
    found = {p.pid: p for p in roots}
    for proc in roots:
        try:
            found.update({c.pid: c for c in proc.children(recursive=True)})
        except psutil.NoSuchProcess:
            pass
    return [proc for proc in found.values() if _alive(proc)]


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stop_cluster(temp_dir: str) -> list[psutil.Process]:
    """Terminate the cluster, kill what outlives 15 s, and return what still runs 10 s after that. A killed process
    turns zombie only once the kernel has torn it down, so each phase polls rather than checking once."""
    remaining = _signal_and_wait(cluster_processes(temp_dir), "terminate", temp_dir, 15)
    return _signal_and_wait(remaining, "kill", temp_dir, 10)


def _signal_and_wait(procs: list[psutil.Process], signal: str, temp_dir: str, seconds: float) -> list[psutil.Process]:
    for proc in procs:
        try:
            getattr(proc, signal)()
        except psutil.NoSuchProcess:
            pass
    deadline = time.monotonic() + seconds
    while (remaining := cluster_processes(temp_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return remaining


@pytest.mark.slow
def test_job_submit_runs_the_quickstart_on_a_loopback_head(tmp_path):
    import httpx
    from ray.job_submission import JobStatus, JobSubmissionClient

    ray = str(Path(sys.executable).parent / "ray")
    temp_dir = tempfile.mkdtemp(prefix="rjob", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    gcs, dashboard, client, agent_http, agent_grpc, metrics, runtime_env, node_manager, object_manager = free_ports(9)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           # Token auth as on a real cluster, with this test's own token (not ~/.ray/auth_token); the CLI and the
           # job's driver read both variables.
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env.pop("RAY_ADDRESS", None)
    out = tmp_path / "run"
    try:
        subprocess.run([ray, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(gcs),
                        "--include-dashboard", "true", "--dashboard-host", "127.0.0.1", "--dashboard-port",
                        str(dashboard), "--ray-client-server-port", str(client), "--dashboard-agent-listen-port",
                        str(agent_http), "--dashboard-agent-grpc-port", str(agent_grpc), "--metrics-export-port",
                        str(metrics), "--runtime-env-agent-port", str(runtime_env), "--node-manager-port",
                        str(node_manager), "--object-manager-port", str(object_manager), "--temp-dir", temp_dir,
                        "--num-cpus", "2", "--disable-usage-stats"],
                       env=env, cwd=ROOT, check=True, capture_output=True, timeout=180)
        started = time.perf_counter()
        job_id = f"quickstart-{secrets.token_hex(4)}"
        job = subprocess.run(
            [ray, "job", "submit", "--address", f"http://127.0.0.1:{dashboard}", "--submission-id", job_id,
             "--working-dir", ".", "--", "python", "learners/run.py", "--config", "configs/tiny.yaml",
             "total_steps=2", "rollout.prompts_per_step=4", "rollout.group_size=4", "logging.progress_bar=false",
             f"output_dir={out}"],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=540)
        print(f"job finished in {time.perf_counter() - started:.0f}s")
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
        jobs = JobSubmissionClient(f"http://127.0.0.1:{dashboard}",
                                   headers={"Authorization": f"Bearer {env['RAY_AUTH_TOKEN']}"})
        assert jobs.get_job_status(job_id) == JobStatus.SUCCEEDED
        assert httpx.get(f"http://127.0.0.1:{dashboard}/api/jobs/").status_code == 401, "the dashboard wants the token"
        assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
        assert (out / "checkpoints" / "latest").resolve().name == "step_2"
        assert (out / "checkpoints" / "step_2" / "model.safetensors").is_file()
    finally:
        leftovers = stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert not leftovers

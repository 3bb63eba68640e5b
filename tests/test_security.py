"""Security defaults: Ray and Serve on loopback unless configured otherwise, weights only from safetensors, and
secrets (the Serve API key, a judge's API key) never in logs, saved configs or metrics.

Checked where the code already keeps them elsewhere: the Serve configs' `http_options.host` and the app builder's
refusal without a key (test_serve.py); the Serve logs after real requests (test_serve.py::
test_the_api_key_never_reaches_the_logs).
"""
import json
from pathlib import Path

import pytest

from cluster.config import ClusterConfig
from learners.config import load_config

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
SERVE_KEY = "serve-key-do-not-log-7f3a9c"
JUDGE_KEY = "judge-key-do-not-log-2b8e41"


def session_processes() -> list:
    """This process and every process it started: with a local Ray, its GCS, raylet, agents and workers."""
    import psutil
    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def listening_addresses(processes) -> dict[str, set]:
    """{process name: the addresses it accepts connections on}."""
    import psutil
    pids = {p.pid: p for p in processes}
    found: dict[str, set] = {}
    for conn in psutil.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in pids:
            try:
                name = pids[conn.pid].name()
            except psutil.NoSuchProcess:
                continue
            found.setdefault(name, set()).add(conn.laddr.ip)
    return found


def test_a_local_ray_advertises_and_listens_on_loopback_only(ray_session):
    """The session fixture starts Ray through cluster.ray_session.start_or_join with the default ClusterConfig."""
    assert ClusterConfig().host == "127.0.0.1" and not ClusterConfig().include_dashboard
    node = ray_session._private.worker.global_worker.node
    assert node.node_ip_address == "127.0.0.1"
    assert node.gcs_address.rpartition(":")[0] == "127.0.0.1"
    assert node._ray_params.dashboard_host == "127.0.0.1"  # where the dashboard binds when it is turned on
    assert {n["NodeManagerAddress"] for n in ray_session.nodes()} == {"127.0.0.1"}
    listening = listening_addresses(session_processes())
    assert any("gcs_server" in name for name in listening) and any("raylet" in name for name in listening)
    exposed = {name: addresses - LOOPBACK for name, addresses in listening.items() if addresses - LOOPBACK}
    assert not exposed, f"listening beyond loopback: {exposed}"


def test_serve_proxy_defaults_to_loopback_and_replicas_never_see_the_key(tiny_model_path, monkeypatch):
    from ray.serve.config import HTTPOptions

    from serve.app import app
    from serve.config import ServeSettings, key_digest

    assert HTTPOptions().host == "127.0.0.1"  # what `serve run` binds when a config names no host
    monkeypatch.delenv("MEDRAY_API_KEY", raising=False)
    with pytest.raises(ValueError, match="no API key"):  # whatever the bind address: no key, no server
        app({"checkpoint": str(tiny_model_path), "engine.max_model_len": "256"})
    built = app({"checkpoint": str(tiny_model_path), "api_key": SERVE_KEY})
    bound = repr((built._bound_deployment.init_args, built._bound_deployment.init_kwargs))
    assert SERVE_KEY not in bound and repr(key_digest(SERVE_KEY)) in bound
    assert ServeSettings(checkpoint=str(tiny_model_path), api_key=SERVE_KEY).resolved().api_key is None


def save_pickled(model, directory: Path) -> None:
    """A model directory in the old format: config.json and weights only as a pickled pytorch_model.bin."""
    import torch
    model.save_pretrained(directory)
    (directory / "model.safetensors").unlink()
    torch.save(model.state_dict(), directory / "pytorch_model.bin")


def test_model_directories_with_pickled_weights_are_refused(tiny_model_path, tmp_path):
    """A user's model path with only pytorch_model.bin (a pickle, which can run code when loaded) is refused by
    the policy loader and the retrieval encoder loader, instead of being unpickled."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, BertConfig

    from indexing.encoders import Encoder
    from learners.batches import load_causal_lm

    policy = tmp_path / "policy"
    save_pickled(AutoModelForCausalLM.from_pretrained(tiny_model_path), policy)
    with pytest.raises(OSError, match="safetensors"):
        load_causal_lm(str(policy), torch.float32)
    assert load_causal_lm(str(tiny_model_path), torch.float32) is not None  # safetensors load

    encoder = tmp_path / "encoder"
    save_pickled(AutoModel.from_config(BertConfig(vocab_size=1100, hidden_size=32, num_hidden_layers=1,
                                                  num_attention_heads=2, intermediate_size=64)), encoder)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(encoder)
    with pytest.raises(OSError, match="safetensors"):
        Encoder(encoder, "cpu", "mean", 32, str(encoder))


@pytest.mark.slow
def test_checkpoints_hold_safetensors_weights_and_no_secret_is_written(ray_session, tmp_path, monkeypatch, capfd):
    """One real training step with a checkpoint, the Serve key and a judge key in the environment: the checkpoint's
    weights are safetensors (the only pickles are DeepSpeed's own resume state under deepspeed/), and neither key
    appears in any file of the run, in the Ray session's logs or on the console."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from learners.trainer import Trainer

    monkeypatch.setenv("MEDRAY_API_KEY", SERVE_KEY)
    monkeypatch.setenv("MEDRAY_JUDGE_API_KEY", JUDGE_KEY)
    out = tmp_path / "run"
    cfg = load_config("configs/tiny.yaml", [
        f"output_dir={out}", "total_steps=1", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "rollout.max_new_tokens=8", "rollout.fidelity_check_every=0", "learner.micro_batch_size=2",
        "logging.progress_bar=false"])
    Trainer(cfg).fit()

    step = out / "checkpoints" / "step_1"
    files = [p.relative_to(step) for p in step.rglob("*") if p.is_file()]
    pickles = [f for f in files if f.suffix in (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")]
    assert Path("model.safetensors") in files and not (step / "pytorch_model.bin").exists()
    assert pickles and all(f.parts[0] == "deepspeed" for f in pickles), pickles
    with safe_open(str(step / "model.safetensors"), "pt") as weights:
        assert any("lm_head" in k for k in weights.keys())
    AutoModelForCausalLM.from_pretrained(step, use_safetensors=True)

    logs = Path(ray_session._private.worker.global_worker.node.get_logs_dir_path())
    written = [p for root in (out, logs) for p in root.rglob("*") if p.is_file()]
    assert (out / "config.yaml") in written and (out / "metrics.jsonl") in written
    console = "".join(capfd.readouterr())
    for secret in (SERVE_KEY, JUDGE_KEY):
        assert secret not in console
        leaks = [p for p in written if secret.encode() in p.read_bytes()]
        assert not leaks, f"{secret[:10]}... found in {leaks}"
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1

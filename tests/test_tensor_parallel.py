"""Tensor-parallel vLLM engines: a sharded engine's bundle holds every shard's CPUs and GPUs (placement and dry run
agree), bad layouts are refused naming the field, and a rollout worker sharded over two vLLM worker processes
generates and takes weight syncs (object store and broadcast) into both shards, scoring as the learner does."""
import socket

import pytest
import ray
import torch

from cluster.config import ClusterConfig
from cluster.placement import PlacementError, bundles, check_fits
from learners.config import FIDELITY_TOLERANCE, load_config
from learners.dry_run import dry_run

SHARDED = {"rollout": {"num": 2, "num_cpus": 2, "num_gpus": 1, "tensor_parallel_size": 2},
           "learner": {"num": 2, "num_cpus": 1, "num_gpus": 1},
           "reward": {"num": 1, "num_cpus": 1}}


def test_a_sharded_engine_reserves_every_shard_in_one_bundle():
    cfg = ClusterConfig.model_validate(SHARDED)
    assert bundles(cfg)["rollout"] == [{"CPU": 4, "GPU": 2}] * 2
    check_fits(cfg, {"CPU": 11, "GPU": 6})  # 2 x 4 + 2 + 1 CPUs, 2 x 2 + 2 GPUs
    with pytest.raises(PlacementError, match=r"needs 6 GPU \(cluster.learner: 2 x 1, cluster.rollout: 2 x 2\).*"
                       r"lower the num_gpus, the tensor_parallel_size or the actor counts"):
        check_fits(cfg, {"CPU": 11, "GPU": 5})


@pytest.mark.parametrize("layout, field", [
    ({"rollout": {"num_gpus": 0.5, "tensor_parallel_size": 2}}, "num_gpus"),
    ({"rollout": {"num_gpus": 2, "tensor_parallel_size": 2}}, "num_gpus"),
    ({"learner": {"tensor_parallel_size": 2}}, "cluster.learner.tensor_parallel_size"),
    ({"rollout": {"tensor_parallel_size": 0}}, "tensor_parallel_size")])
def test_bad_tensor_parallel_layouts_are_refused_naming_the_field(layout, field):
    with pytest.raises(ValueError, match=field):
        ClusterConfig.model_validate(layout)


def test_the_dry_run_counts_a_gpu_per_shard_on_one_node():
    cfg = load_config("configs/med_r3_cluster.yaml")
    assert cfg.cluster.judge.tensor_parallel_size == 2
    plan = dry_run(cfg, gpus_per_node=8, gpu_memory_gb=80)
    rows = {row["actor"]: row for row in plan["placement"]}
    assert rows["judge-0"]["gpus"] == [6, 7] and rows["judge-0"]["cpus"] == 4
    assert plan["gpus"] == 8 == sum(b.get("GPU", 0) for role in bundles(cfg.cluster, ("learner", "rollout", "judge"))
                                    .values() for b in role)
    sharded = load_config("configs/med_r3_cluster.yaml", ["cluster.rollout.tensor_parallel_size=2"])
    plan = dry_run(sharded, gpus_per_node=8, gpu_memory_gb=80)
    assert plan["gpus"] == 10 and plan["nodes"] == 2
    assert [row["gpus"] for row in plan["placement"] if row["role"] == "rollout"] == [[4, 5], [6, 7]]
    assert plan["rollout_gib_per_worker"] == pytest.approx(2 * 0.8 * 80)
    too_wide = load_config("configs/med_r3_cluster.yaml", ["cluster.judge.tensor_parallel_size=4"])
    assert any("cluster.judge: 4 GPUs per actor" in w for w in dry_run(too_wide, gpus_per_node=2)["warnings"])


def test_a_serve_replica_with_fewer_gpus_than_shards_is_refused_naming_the_option():
    from serve.config import ServeEngineSettings
    from serve.engine import start_engine

    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 needs 2 GPUs.*num_gpus: 2 in the ChatServer"):
        start_engine("unused", ServeEngineSettings(tensor_parallel_size=2), "cuda", num_cpus=4, num_gpus=1)


@pytest.mark.slow
def test_a_rollout_worker_sharded_in_two_takes_weight_syncs_into_both_shards(ray_session, tiny_model_path):
    """TP=2 on CPU: two vLLM worker processes with one thread each. The engine's log-probabilities (of its own samples
    and of a prompt) are the learner's within the float32 fidelity tolerance, before and after a sync through the
    object store and one through a gloo broadcast that each shard receives itself."""
    from transformers import AutoModelForCausalLM

    from actors.rollout_worker import RolloutWorker
    from cluster.weight_sync import WeightPublisher, broadcast_weights, join_broadcast_group

    tolerance = FIDELITY_TOLERANCE["float32"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    worker = RolloutWorker.options(num_cpus=0, name="RolloutWorker-tp2").remote(
        str(tiny_model_path), seed=0, threads=1, tensor_parallel_size=2, max_model_len=256, kv_cache_gb=0.0625)
    prompt = list(range(5, 45))

    def learner_logprobs(sequence: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logp = model(torch.tensor([sequence])).logits[0, :-1].log_softmax(-1)
        return logp[torch.arange(len(sequence) - 1), sequence[1:]]

    def engine_logprobs() -> torch.Tensor:
        return torch.tensor(ray.get(worker.prompt_logprobs.remote([prompt]))[0])

    def perturb() -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.05)

    try:
        sample = ray.get(worker.generate.remote([prompt], {"temperature": 1.0, "max_tokens": 12}, [7]))[0]
        assert len(sample["ids"]) == 12
        own = learner_logprobs(prompt + sample["ids"])[-12:]
        assert torch.allclose(torch.tensor(sample["logprobs"]), own, atol=tolerance)
        before = engine_logprobs()
        assert torch.allclose(before, learner_logprobs(prompt), atol=tolerance)

        perturb()
        manifest = WeightPublisher(bucket_mb=0.25).publish(  # several buckets: layers span them
            ((n, p.detach()) for n, p in model.named_parameters()), version=1)
        assert len(manifest.buckets) > 2
        ray.get(worker.update_weights.remote(manifest))
        synced = engine_logprobs()
        assert (synced - before).abs().max() > 100 * tolerance, "the sync changed what the engine computes"
        assert torch.allclose(synced, learner_logprobs(prompt), atol=tolerance)

        perturb()
        named = [(n, p.detach()) for n, p in model.named_parameters()]
        meta = [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in named]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            host, port = "127.0.0.1", s.getsockname()[1]
        joined = worker.join_broadcast_group.remote(host, port, 3, 1)
        group = join_broadcast_group(host, port, 3, 0, "cpu")
        assert ray.get(joined) == [1, 2], "each shard is a rank of its own"
        received = worker.receive_broadcast.remote(2, meta)
        broadcast_weights(group, named)
        ray.get(received)
        assert ray.get(worker.ready.remote())["version"] == 2
        broadcast = engine_logprobs()
        assert (broadcast - synced).abs().max() > 100 * tolerance, "the broadcast changed what the engine computes"
        assert torch.allclose(broadcast, learner_logprobs(prompt), atol=tolerance)
    finally:
        ray.kill(worker)


MESSAGES = [{"role": "user", "content": "Tall stature and lens dislocation?"}]


def greedy_reply(model_path, max_tokens: int) -> str:
    """What the unsharded model (transformers, float32) writes greedily after the chat prompt of MESSAGES."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


def shard_processes(pid: int) -> list[str]:
    """The vLLM shard worker processes under process `pid`, by title."""
    import psutil

    return sorted(title for child in psutil.Process(pid).children(recursive=True)
                  if (title := " ".join(child.cmdline()).strip()).startswith("VLLM::Worker_TP"))


@pytest.mark.slow
def test_a_serve_replica_sharded_in_two_answers_what_the_whole_model_writes(ray_session, tiny_model_path):
    """One CPU per replica, one thread per shard; the OpenAI route returns the unsharded model's greedy reply."""
    import psutil
    from openai import OpenAI
    from ray import serve

    from serve.app import app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(app({"checkpoint": str(tiny_model_path), "api_key": "tp-key", "engine.max_model_len": "256",
                       "engine.kv_cache_gb": "1", "engine.tensor_parallel_size": "2"}),
                  name="medray-tp", route_prefix="/")
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="tp-key", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="medray", messages=MESSAGES, max_tokens=16, temperature=0)
        assert reply.choices[0].message.content == greedy_reply(tiny_model_path, 16)
        replica = next(p.pid for p in psutil.process_iter(["cmdline"])
                       if "ServeReplica:medray-tp:ChatServer" in " ".join(p.info["cmdline"] or []))
        assert shard_processes(replica) == ["VLLM::Worker_TP0", "VLLM::Worker_TP1"]
    finally:
        serve.shutdown()

"""The object-store weight transport: exact round trip, buckets bounded in size, previous round released; a tied LM
head in vLLM follows a sync."""
import pytest
import ray
import torch

from cluster.weight_sync import WeightPublisher, receive_weights


def test_round_trip_in_bounded_buckets(ray_session):
    weights = [(f"layer.{i}.weight", torch.randn(300, 100)) for i in range(6)]  # 120 kB each (fp32)
    weights += [("norm.weight", torch.randn(100).to(torch.bfloat16))]
    publisher = WeightPublisher(bucket_mb=0.25)
    manifest = publisher.publish(iter(weights), version=3)
    assert manifest.version == 3
    # a bucket closes once it reaches 0.25 MB: at most 3 tensors of 120 kB each
    assert all(len(slots) <= 3 for _, slots in manifest.buckets) and len(manifest.buckets) >= 3
    received = dict(receive_weights(manifest))
    assert list(received) == [name for name, _ in weights]
    for name, tensor in weights:
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor)
    assert manifest.num_bytes == sum(t.numel() * t.element_size() for _, t in weights)


def test_next_round_reuses_buffers_and_carries_new_values(ray_session):
    publisher = WeightPublisher(bucket_mb=1)
    first = publisher.publish(iter([("w", torch.zeros(1000))]), version=1)
    buffers = {k: v.ctypes.data for k, v in publisher.buffers.items()}
    second = publisher.publish(iter([("w", torch.ones(1000))]), version=2)
    assert {k: v.ctypes.data for k, v in publisher.buffers.items()} == buffers
    assert torch.equal(dict(receive_weights(second))["w"], torch.ones(1000))
    assert torch.equal(dict(receive_weights(first))["w"], torch.zeros(1000))  # a reader's round stays intact


def test_a_publisher_that_keeps_no_buffers_holds_nothing_between_rounds(ray_session):
    publisher = WeightPublisher(bucket_mb=1, keep_buffers=False)
    for version, value in ((1, 0.0), (2, 1.0)):
        manifest = publisher.publish(iter([("w", torch.full((1000,), value))]), version=version)
        assert publisher.buffers == {} and torch.equal(dict(receive_weights(manifest))["w"], torch.full((1000,), value))


@pytest.mark.slow
def test_a_tied_lm_head_scores_with_the_synced_embeddings(ray_session):
    """Qwen2.5 0.5B-3B tie the LM head to the embeddings: after a sync that changes only the embeddings, the
    engine's logprobs must be the learner's (on CPU the head used to keep its copy packed at load)."""
    from transformers import AutoModelForCausalLM

    from actors.rollout_worker import RolloutWorker
    from tasks.tiny_models import TinyModelConfig
    from tasks.tiny_models import ensure_tiny_model

    path = ensure_tiny_model(TinyModelConfig(tie_embeddings=True))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    worker = RolloutWorker.options(num_cpus=0, name="RolloutWorker-tied").remote(str(path), seed=0, threads=1)
    sequence = list(range(5, 60))

    def learner_logprobs() -> torch.Tensor:
        with torch.no_grad():
            logp = model(torch.tensor([sequence])).logits[0, :-1].log_softmax(-1)
        return logp[torch.arange(len(sequence) - 1), sequence[1:]]

    try:
        with torch.no_grad():
            model.model.embed_tokens.weight.add_(torch.randn_like(model.model.embed_tokens.weight),
                                                 alpha=0.5)
        manifest = WeightPublisher(bucket_mb=16).publish(
            ((n, p.detach()) for n, p in model.named_parameters()), version=1)
        ray.get(worker.update_weights.remote(manifest))
        engine = torch.tensor(ray.get(worker.prompt_logprobs.remote([sequence]))[0])
        assert torch.allclose(engine, learner_logprobs(), atol=1e-3)
    finally:
        ray.kill(worker)

"""The object-store weight transport: exact round trip, buckets bounded in size, previous round released."""
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

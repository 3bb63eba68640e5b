"""Fully asynchronous rollouts on a real vLLM worker: episodes go on across slices, new weights reach those in flight
(a partial rollout), and each token keeps the weight version that sampled it."""
import pytest
import ray
import torch

from actors.rollout_worker import RolloutCall, RolloutWorker
from cluster.weight_sync import WeightPublisher
from learners.config import load_config


@pytest.mark.slow
def test_an_episode_in_flight_takes_new_weights_and_tags_each_token_with_its_version(ray_session, tiny_model_path):
    from transformers import AutoModelForCausalLM

    worker = RolloutWorker.options(num_cpus=0, name="RolloutWorker-stream").remote(str(tiny_model_path), seed=0,
                                                                                   threads=1)
    task = {"id": "t0", "messages": [{"role": "user", "content": "Which disease? A, B, C or D"}], "answer": "A"}
    # min_tokens: the episodes cannot end in the first slice, whatever the random model writes
    call = RolloutCall([task], [7], 2, {"temperature": 1.0, "max_tokens": 24, "min_tokens": 24}, seed=3)
    try:
        *groups, summary = worker.stream.options(num_returns="streaming").remote(call, 0.0)
        summary = ray.get(summary)
        assert groups == [] and summary.groups == [] and summary.in_flight == 1

        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        manifest = WeightPublisher(bucket_mb=16).publish(((n, p.detach()) for n, p in model.named_parameters()),
                                                         version=1)
        ray.get(worker.update_weights.remote(manifest))

        empty = RolloutCall([], [], 2, call.sampling, seed=3)
        *groups, summary = worker.stream.options(num_returns="streaming").remote(empty, 60.0)
        summary = ray.get(summary)
        (meta,) = summary.groups
        assert meta.group == 7 and meta.version == 0 and meta.partial and summary.in_flight == 0
        (trajectories,) = ray.get(groups)
        for t in trajectories:
            assert t.group == 7 and t.weight_version == 0 and len(t.versions) == len(t.response_ids) == 24
            # the first tokens came from version 0, the rest from version 1, in one run
            first_new = t.versions.index(1)
            assert 0 < first_new and set(t.versions[:first_new]) == {0} and set(t.versions[first_new:]) == {1}
    finally:
        ray.kill(worker)


def test_fully_async_is_refused_where_it_cannot_keep_its_bound(tmp_path):
    with pytest.raises(ValueError, match="max_staleness"):
        load_config("configs/tiny.yaml", [f"output_dir={tmp_path}", "async=fully_async", "max_staleness=-1"])
    with pytest.raises(ValueError, match="fully_async needs cluster.weight_sync object_store"):
        load_config("configs/tiny.yaml", [f"output_dir={tmp_path}", "async=fully_async",
                                          "cluster.weight_sync=collective"])
    with pytest.raises(ValueError, match="one_step_off"):
        load_config("configs/tiny.yaml", [f"output_dir={tmp_path}", "async=fully_asynchronous"])

"""Placement on a cluster that can scale: the run's bundles are asked for and waited on, with progress, instead of
being refused for the nodes that happen to be up; a layout that never fits times out naming what it waited for and
leaves nothing reserved."""
import logging

import pytest

from cluster.placement import PlacementError, check_fits, place
from cluster.config import ClusterConfig

TOO_BIG = {"rollout": {"num": 1, "num_cpus": 64}, "learner": {"num": 1, "num_cpus": 0.25},
           "reward": {"num": 1, "num_cpus": 0.25}}


def test_a_fixed_cluster_refuses_a_layout_larger_than_it_at_once():
    with pytest.raises(PlacementError, match=r"cluster.rollout: 1 x 64"):
        check_fits(ClusterConfig.model_validate(TOO_BIG), {"CPU": 2})


def test_an_autoscaling_cluster_waits_for_the_bundles_and_says_for_which_roles(ray_session, caplog):
    import ray

    cfg = ClusterConfig.model_validate({**TOO_BIG, "autoscale": True, "placement_timeout_s": 4})
    with caplog.at_level(logging.INFO, "medray.placement"):
        with pytest.raises(PlacementError, match=r"after 4s, still waiting for cluster.rollout: 1 x \{CPU: 64\}"):
            place(cfg, progress_every_s=1)
    waits = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for")]
    assert len(waits) >= 2 and all("cluster.rollout: 1 x {CPU: 64}" in w for w in waits)
    assert not any("cluster.learner" in w for w in waits[1:]), "roles already placed are not reported as waiting"
    left = [g for g in ray.util.placement_group_table().values()
            if g["name"].startswith("medray-") and g["state"] != "REMOVED"]
    assert left == [], "a timed-out placement releases every group it asked for"


def test_the_allocator_env_keeps_other_preloaded_libraries_and_defers_to_a_preloaded_allocator(monkeypatch):
    from pathlib import Path

    import ray

    from cluster.devices import allocator_env

    jemalloc = str(Path(ray.__file__).parent / "core" / "libjemalloc.so")
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libsandbox.so")
    assert allocator_env()["LD_PRELOAD"] == f"{jemalloc}:/usr/lib/libsandbox.so"
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libtcmalloc_minimal.so.4")
    assert allocator_env() == {}
    monkeypatch.delenv("LD_PRELOAD")
    assert allocator_env()["LD_PRELOAD"] == jemalloc


def test_an_actor_started_with_the_allocator_env_keeps_freed_pages_until_released(ray_session):
    """Learner ranks start with allocator_env(): jemalloc must be what the process allocates with, keep what a freed
    tensor held (no page faults for the next micro-batch) until release_freed_memory() returns it, and the session's
    own worker variables (zero-copy tensors, passive OpenMP waits) must still reach it. With
    learner.keep_freed_memory false the freed pages go back at once."""
    import os

    from cluster.devices import allocator_env

    if "malloc" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip(f"this test run preloads another allocator: {os.environ['LD_PRELOAD']}")
    env = allocator_env()
    assert env, "Ray ships ray/core/libjemalloc.so on Linux"

    @ray_session.remote(num_cpus=0)
    def process_state() -> tuple:
        import os

        import torch

        from cluster.devices import release_freed_memory

        def resident_gb() -> float:
            with open("/proc/self/statm") as fh:
                return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
        with open("/proc/self/maps") as fh:
            jemalloc = "libjemalloc" in fh.read()
        before = resident_gb()
        block = torch.ones(2**28 // 4)  # 256 MiB
        del block
        kept = resident_gb() - before
        release_freed_memory()
        return jemalloc, os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"), kept, resident_gb() - before

    jemalloc, zero_copy, kept, after_release = ray_session.get(
        process_state.options(runtime_env={"env_vars": env}).remote())
    assert (jemalloc, zero_copy) == (True, "1")
    assert kept > 0.2 and after_release < 0.05
    jemalloc, _, kept, _ = ray_session.get(
        process_state.options(runtime_env={"env_vars": allocator_env(keep_freed=False)}).remote())
    assert jemalloc and kept < 0.05
    assert ray_session.get(process_state.remote())[0] is False  # other actors keep glibc's allocator


def test_a_learner_rank_does_not_grow_with_each_new_micro_batch_length(ray_session):
    """Packed micro-batches have a length of their own; under bfloat16 autocast each new one compiles oneDNN kernels
    that a process caches. A learner rank's environment bounds those caches, so its live memory stops growing with
    the lengths it has seen (jemalloc's count of allocated bytes), where a process with the default caches keeps
    growing."""
    from cluster.devices import allocator_env, learner_env

    if not allocator_env():
        pytest.skip("jemalloc (ray/core/libjemalloc.so) is what counts the live bytes")

    @ray_session.remote(num_cpus=0)
    def growth_mb(lengths: int) -> float:
        import torch

        from cluster.devices import allocated_gb

        def allocated_mb() -> float:
            return allocated_gb() * 1e9 / 2**20

        torch.set_num_threads(1)
        layer = torch.nn.Linear(256, 512)

        def step(n: int) -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                layer(torch.randn(n, 256, requires_grad=True)).float().sum().backward()
        step(100)
        before = allocated_mb()
        for n in range(101, 101 + lengths):
            step(n)
        return allocated_mb() - before

    bounded = ray_session.get(growth_mb.options(runtime_env={"env_vars": learner_env()}).remote(200))
    default = ray_session.get(growth_mb.options(runtime_env={"env_vars": allocator_env()}).remote(200))
    assert bounded < 80 and default > 3 * bounded, (bounded, default)

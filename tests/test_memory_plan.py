"""Host memory known before a CPU run starts: the estimate, its calibration against measured peaks, the dry run's
table, and the refusal of a run that cannot fit."""
import json
import os
import time
from collections import namedtuple
from pathlib import Path

import pytest

from cluster.placement import PlacementError
from learners.config import load_config
from learners.memory_plan import NodeWatch, check_local_run, fit_problems, learner_rank_gb, phase_totals

ROOT = Path(__file__).resolve().parents[1]
# SmolLM2-135M-Instruct's shape (its config.json): what the quickstart trains
SMOLLM2 = dict(params=134_515_008, layers=30, hidden=576, vocab=49152)


def test_a_learner_rank_by_hand():
    # resident: 0.7 GB process + 1e6 params x (4 + 4/2 + 8/2 = 10 ZeRO-2 bytes over 2 ranks + 23 buffer bytes)
    # activations: 1000 tokens x 2 layers x 10 hidden x 35 floats x 4 bytes = 2.8e6; logits: 3 x 512 x 100 x 4
    est = learner_rank_gb(10**6, 2, 10, 100, 1000, ranks=2, zero_stage=2)
    assert est["resident"] == pytest.approx(0.733)
    assert est["peak"] == pytest.approx(0.733 + 2.8e-3 + 614_400 / 1e9)
    # checkpointing keeps each layer's input (1000 x 2 x 10 x 4) and one layer's full set (1000 x 10 x 35 x 4)
    ckpt = learner_rank_gb(10**6, 2, 10, 100, 1000, ranks=2, zero_stage=2, checkpointing=True)
    assert ckpt["peak"] == pytest.approx(0.733 + 80_000 / 1e9 + 1.4e-3 + 614_400 / 1e9)


@pytest.mark.parametrize("results, variant, checkpointing, trainable, compute_dtype, keep_freed", [
    ("step_real", "shipped", False, None, "float32", True),
    ("step_real", "checkpointing", True, None, "float32", True),
    # LoRA rank 16 on every linear layer of the decoder: 4,884,480 adapter parameters
    ("step_lora_lean", "lora", False, 4_884_480, "float32", True),
    ("step_lora_lean", "lora_checkpointing", True, 4_884_480, "float32", True),
    # where the learner computes in bfloat16 (AVX512-BF16), freed pages kept and returned
    ("step_lean", "shipped", False, None, "bfloat16", True),
    ("step_lean", "checkpointing", True, None, "bfloat16", True),
    ("step_lean", "released", False, None, "bfloat16", False),
    ("step_lean", "checkpointing_released", True, None, "bfloat16", False)])
def test_the_estimate_is_within_ten_percent_of_the_measured_real_model_peaks(results, variant, checkpointing,
                                                                             trainable, compute_dtype, keep_freed):
    rows = {r["variant"]: r for r in json.loads((ROOT / f"benchmarks/results/{results}.json").read_text())["rows"]}
    tokens = 4 * rows[variant]["tokens_per_sequence"]  # micro_batch_size 4, packed
    est = learner_rank_gb(SMOLLM2["params"], SMOLLM2["layers"], SMOLLM2["hidden"], SMOLLM2["vocab"],
                          int(tokens), ranks=2, zero_stage=2, checkpointing=checkpointing, trainable=trainable,
                          compute_dtype=compute_dtype, keep_freed=keep_freed)
    assert est["peak"] == pytest.approx(rows[variant]["memory/learner_peak_gb"], rel=0.1), variant


def test_lora_trains_only_its_adapters():
    cfg = load_config("configs/quickstart_lora.yaml")
    from learners.memory_plan import model_size, trainable_params
    params, _, model_config = model_size(cfg)
    # rank 16 x (in + out) over q, k, v, o (576 -> 576, 192, 192, 576) and gate, up, down (576 <-> 1536), 30 layers
    assert trainable_params(cfg, params, model_config) == 30 * 16 * (2 * 1152 + 2 * 768 + 3 * 2112)


def test_fit_problems_refuse_what_cannot_fit_and_warn_near_the_threshold():
    rows = [{"role": "driver", "num": 1, "resident_gb": 0.7, "floor_gb": 0.7, "peak_gb": 0.7},
            {"role": "learner", "num": 2, "resident_gb": 5.0, "floor_gb": 8.0, "peak_gb": 15.0},
            {"role": "rollout", "num": 1, "resident_gb": 5.0, "floor_gb": 5.0, "peak_gb": 5.0}]
    assert [phase_totals(rows, k) for k in ("resident_gb", "floor_gb", "peak_gb")] == pytest.approx([15.7, 21.7, 35.7])
    small = fit_problems(rows, 15.0)  # the resident 15.7 GB alone exceed the machine
    assert "needs ~15.7 GB" in small["cannot_fit"] and "largest role is learner" in small["cannot_fit"]
    assert "learner.gradient_checkpointing" in small["cannot_fit"] and small["at_floor"] is None
    near = fit_problems(rows, 22.0)  # fits, but 21.7 GB at the floor pass 0.95 x 22 = 20.9
    assert near["cannot_fit"] is None and "~21.7 GB" in near["at_floor"] and "20.9 GB" in near["at_floor"]
    budget = fit_problems(rows, 30.0)  # passes 0.95 x 30 only at the budget
    assert budget["at_floor"] is None and "~35.7 GB" in budget["at_budget"] and "learner 2 x 15.0" in budget["at_budget"]
    assert fit_problems(rows, 40.0) == {"cannot_fit": None, "at_floor": None, "at_budget": None}


def test_the_dry_run_prints_host_memory_and_fails_on_a_machine_too_small(capsys):
    from learners.run import main
    assert main(["--config", "configs/tiny.yaml", "--dry-run", "--node-memory-gb", "64"]) == 0
    out = capsys.readouterr().out
    assert "host memory" in out and "learner" in out and "total" in out
    assert main(["--config", "configs/tiny.yaml", "--dry-run", "--node-memory-gb", "1"]) == 2
    assert "error: between steps the run needs" in capsys.readouterr().out


def test_a_local_run_that_cannot_fit_stops_before_ray_starts(monkeypatch):
    import psutil
    import ray
    cfg = load_config("configs/tiny.yaml")
    machine = namedtuple("Memory", "total available")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: machine(1e9, 0.5e9))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    started = ray.is_initialized()
    with pytest.raises(PlacementError, match=r"needs ~[\d.]+ GB of host memory.* 1.0 GB machine"):
        check_local_run(cfg, ("learner", "rollout", "reward"))
    assert ray.is_initialized() == started


def test_the_node_watch_warns_once_near_the_memory_threshold(monkeypatch, caplog):
    import psutil
    machine = namedtuple("Memory", "total available")
    watch = NodeWatch()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: machine(100.0, 50.0))
    monkeypatch.setattr(psutil, "cpu_percent", lambda: 87.5)
    assert watch({"step": 1, "memory/learner_peak_gb": 9.0}) == {"memory/node_used_fraction": 0.5,
                                                                "cpu/node_busy_fraction": 0.875}
    assert not caplog.records
    monkeypatch.setattr(psutil, "virtual_memory", lambda: machine(100.0, 8.0))  # 92% used: within 5 points of 95%
    record = {"step": 2, "memory/learner_peak_gb": 9.0, "memory/rollout_peak_gb": 5.0}
    assert watch(record)["memory/node_used_fraction"] == pytest.approx(0.92)
    watch(record)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "92% used" in warnings[0] and "largest role is learner at 9.0 GB" in warnings[0]


def test_the_node_watch_reports_the_cpu_share_a_busy_loop_takes():
    watch = NodeWatch()
    end = time.perf_counter() + 0.5
    while time.perf_counter() < end:  # one core busy
        pass
    assert 0.8 / os.cpu_count() <= watch({"step": 1})["cpu/node_busy_fraction"] <= 1.0


def test_a_process_tensors_count_each_storage_once():
    import gc

    import torch

    from cluster.devices import resident_gb, tensors_gb

    gc.collect()  # tensors in unreachable cycles would otherwise be counted once and collected before the second look
    before = tensors_gb()
    weights = torch.ones(25_000_000)  # 100 MB, and a view of it that holds no memory of its own
    view = weights[:10]
    assert tensors_gb() - before == pytest.approx(0.1, abs=0.005) and view.sum() == 10
    assert resident_gb() > tensors_gb()


def test_tensors_without_data_count_nothing():
    """torch.compile (a vLLM engine in the same process) leaves fake and functional tensors: no storage to read."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    from cluster.devices import tensors_gb

    before = tensors_gb()
    with FakeTensorMode():
        fake = torch.ones(25_000_000)
    with FunctionalTensorMode():
        functional = torch.ones(25_000_000)
    assert fake.numel() == functional.numel() and tensors_gb() == pytest.approx(before, abs=0.005)

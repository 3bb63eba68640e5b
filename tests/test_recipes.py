"""Every recipe config validates, and its dry run resolves stages and placement without starting anything."""
from pathlib import Path

import pytest

from learners.config import load_config
from learners.dry_run import device_plan, dry_run
from learners.memory_plan import learner_bytes

RUN_CONFIGS = sorted(p for p in Path("configs").glob("*.yaml") if not p.name.startswith("serve"))
# Max |engine - learner| logprob on identical weights, kernel rounding alone (README *Fidelity*; CPU, sharp tiny model).
ROUNDING_MEASURED = {"float32": 3.6e-4, "bfloat16": 0.66, "float16": 0.66}


def test_the_five_recipes_and_their_cluster_variants_exist():
    names = {p.stem for p in RUN_CONFIGS}
    for recipe in ("med_rwr", "med_r3", "armed", "medvr", "medvistagym"):
        assert {recipe, f"{recipe}_cluster"} <= names, recipe


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: p.stem)
def test_recipe_config_validates_and_its_plan_resolves(path):
    cfg = load_config(path)
    plan = dry_run(cfg, gpus_per_node=8, gpu_memory_gb=80)
    assert [s["name"] for s in plan["stages"]] == [s.name for s in cfg.stage_plan()]
    assert plan["parameters"] > 0
    if cfg.rollout.fidelity_check_every:  # must not stop a run on rounding (the old 1e-4 sat below bfloat16's)
        assert cfg.fidelity_tolerance() > ROUNDING_MEASURED[cfg.model.dtype]
        assert load_config(path, ["rollout.fidelity_tolerance=1e-5"]).fidelity_tolerance() == 1e-5
    if path.stem.endswith("_cluster"):  # the paper's scale: GPUs for learners and rollouts, fitting in memory
        roles = {row["role"] for row in plan["placement"] if row["gpus"]}
        assert {"learner", "rollout"} <= roles and plan["gpus"] <= 8 * plan["nodes"]
        assert not plan["warnings"], plan["warnings"]
        assert cfg.learner.lr == 1e-6


def test_memory_estimate_follows_zero_accounting():
    # bf16: 2 bytes weights (whole under ZeRO-2) + (2 grads + 12 fp32 Adam) / 4 ranks = 5.5 bytes per parameter
    assert learner_bytes(10**9, "bfloat16", 2, 4, reference=False) == pytest.approx(5.5e9)
    # ZeRO-3 partitions the weights too: (2 + 2 + 12) / 4 = 4; a frozen bf16 reference adds 2
    assert learner_bytes(10**9, "bfloat16", 3, 4, reference=True) == pytest.approx(6.0e9)
    # ZeRO-1 partitions only Adam's state: 2 + 2 + 12 / 4 = 7
    assert learner_bytes(10**9, "bfloat16", 1, 4, reference=False) == pytest.approx(7.0e9)


def test_a_bfloat16_engine_beside_a_float32_learner_is_checked_at_bfloat16s_tolerance():
    same = load_config("configs/quickstart.yaml", ["rollout.dtype=float32"])
    assert (same.model.dtype, same.engine_dtype(), same.fidelity_tolerance()) == ("float32", "float32", 1e-3)
    engine = load_config("configs/quickstart.yaml", ["rollout.dtype=bfloat16"])
    assert engine.engine_dtype() == "bfloat16" and engine.fidelity_tolerance() > ROUNDING_MEASURED["bfloat16"]
    assert dry_run(engine)["parameters"] == dry_run(same)["parameters"]


@pytest.mark.parametrize("native, gpus, engine", [(True, 0, "bfloat16"), (False, 0, "float32"), (False, 1, "bfloat16")])
def test_an_auto_engine_dtype_is_bfloat16_only_where_it_multiplies_natively(monkeypatch, native, gpus, engine):
    import cluster.devices
    monkeypatch.setattr(cluster.devices, "fast_bfloat16", lambda device: native)
    cfg = load_config("configs/tiny.yaml", ["rollout.dtype=auto", f"cluster.rollout.num_gpus={gpus}"])
    assert cfg.engine_dtype() == engine and cfg.engine_args()["dtype"] == engine


def test_placement_packs_whole_gpus_and_shares_fractions():
    cfg = load_config("configs/med_rwr_cluster.yaml")
    plan = {row["actor"]: row for row in device_plan(cfg, ("learner", "rollout", "reward"), gpus_per_node=8)}
    assert [plan[f"learner-{i}"]["gpus"] for i in range(4)] == [[0], [1], [2], [3]]
    assert plan["reward-0"]["gpus"] == plan["reward-1"]["gpus"] == [7]   # two 0.5-GPU actors on one device
    small = device_plan(cfg, ("learner", "rollout", "reward"), gpus_per_node=4)
    assert {row["node"] for row in small if row["role"] == "rollout"} == {1}   # the learners fill node 0


def test_dry_run_lists_the_tool_actors_and_their_gpus():
    cfg = load_config("configs/medvr_cluster.yaml", ["tools.tools.zoom_in.replicas=2", "tools.tools.zoom_in.num_gpus=0.5"])
    plan = dry_run(cfg)
    tools = [row for row in plan["placement"] if row["role"] == "zoom_in"]
    assert [row["actor"] for row in tools] == ["zoom_in-0", "zoom_in-1"]
    assert [row["gpus"] for row in tools] == [[tools[0]["gpus"][0]]] * 2  # two halves of one GPU
    assert plan["gpus"] == pytest.approx(sum(r["gpu_share"] for r in plan["placement"] if r["role"] != "zoom_in") + 1)

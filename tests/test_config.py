"""Configs and datasets: typed validation, overrides, and errors that say where the problem is."""
import json
import textwrap

import pytest

from cluster.placement import PlacementError, check_fits
from cluster.config import ClusterConfig
from learners.config import ConfigError, load_config
from learners.data import PromptSampler, load_tasks

QUICKSTART = "configs/tiny.yaml"


def test_quickstart_config_loads_and_overrides_apply():
    cfg = load_config(QUICKSTART, ["rollout.group_size=4", "learner.lr=0.5", "async=one_step_off"])
    assert cfg.rollout.group_size == 4 and cfg.learner.lr == 0.5 and cfg.async_mode == "one_step_off"
    assert cfg.dump()["async"] == "one_step_off"


def write(tmp_path, text):
    path = tmp_path / "bad.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_unknown_key_names_file_line_and_field(tmp_path):
    path = write(tmp_path, """\
        output_dir: out
        total_steps: 2
        data: {train: x.jsonl}
        rewards: {components: [{name: accuracy}]}
        rollout:
          group_size: 4
          temprature: 0.7
        """)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(path) in str(e.value) and "rollout.temprature (line 7)" in str(e.value)


def test_wrong_type_and_bad_override(tmp_path):
    path = write(tmp_path, """\
        output_dir: out
        total_steps: many
        data: {train: x.jsonl}
        rewards: {components: [{name: accuracy}]}
        """)
    with pytest.raises(ConfigError, match=r"total_steps \(line 2\)"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"rollout.group_size \(command-line override\)"):
        load_config(QUICKSTART, ["rollout.group_size=-1"])
    with pytest.raises(ConfigError, match="dotted.key=value"):
        load_config(QUICKSTART, ["rollout.group_size"])


def test_invalid_yaml_names_file(tmp_path):
    path = write(tmp_path, "output_dir: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(path)


def test_batch_must_divide_over_learner_ranks():
    with pytest.raises(ConfigError, match="learner ranks"):
        load_config(QUICKSTART, ["rollout.prompts_per_step=3", "rollout.group_size=1", "cluster.learner.num=2"])


def test_mini_batch_must_divide_the_rollout_batch_and_the_ranks():
    # quickstart: 4 prompts x 4 samples on 2 learner ranks
    assert load_config(QUICKSTART, ["learner.mini_batch_size=8"]).learner.mini_batch_size == 8
    for bad in (6, 1):
        with pytest.raises(ConfigError, match="mini_batch_size"):
            load_config(QUICKSTART, [f"learner.mini_batch_size={bad}"])


def test_impossible_resources_are_refused_naming_the_fields():
    cfg = ClusterConfig.model_validate({"rollout": {"num": 4, "num_gpus": 1}})
    with pytest.raises(PlacementError, match=r"GPU .*cluster.rollout: 4 x 1"):
        check_fits(cfg, {"CPU": 16, "GPU": 2})


def test_malformed_dataset_line_names_file_and_line(tmp_path):
    good = {"id": "a", "messages": [{"role": "user", "content": "q"}], "answer": "A", "options": {"A": "x"},
            "images": [], "gold_boxes": [], "references": [], "metadata": {}}
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(good) + "\n" + '{"id": "b", "messages": []\n')
    with pytest.raises(ValueError, match=rf"{path}:2"):
        load_tasks(str(path))
    with pytest.raises(FileNotFoundError, match="data.train"):
        load_tasks(str(tmp_path / "missing.jsonl"))


def test_sampler_is_a_function_of_step():
    a, b = PromptSampler(10, 4, seed=3), PromptSampler(10, 4, seed=3)
    assert [a.batch(s) for s in range(5)] == [b.batch(s) for s in reversed(range(5))][::-1]
    first_epoch = a.batch(0) + a.batch(1) + a.batch(2)[:2]
    assert sorted(first_epoch) == list(range(10))


def test_a_fresh_run_never_overwrites_an_earlier_one(tmp_path):
    from learners.trainer import Trainer
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    cfg = load_config(QUICKSTART, [f"output_dir={tmp_path}"])
    with pytest.raises(FileExistsError, match="resume=true"):
        Trainer(cfg).fit()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_tool_actors_count_against_the_cluster_naming_the_tool():
    """Tool actors run beside the placement groups; a layout whose tools do not fit is refused up front."""
    from learners.services import tool_demand

    cfg = load_config("configs/medvistagym.yaml", ["tools.tools.zoom_in.replicas=8", "tools.tools.zoom_in.num_cpus=1"])
    demand = tool_demand(cfg)
    assert demand["tools.tools.zoom_in"] == {"num": 8, "CPU": 1.0, "GPU": 0.0}
    check_fits(cfg.cluster, {"CPU": 64.0}, others=demand)  # fits a larger cluster
    with pytest.raises(PlacementError, match=r"cluster has 2; .*") as err:
        check_fits(cfg.cluster, {"CPU": 2.0}, others=demand)
    assert "tools.tools.zoom_in: 8 x 1" in str(err.value)

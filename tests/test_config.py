"""Configs and datasets: typed validation, overrides, and errors that say where the problem is."""
import json
import textwrap
from pathlib import Path

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



def test_extends_merges_over_the_base_and_errors_name_the_file_the_key_came_from(tmp_path):
    (tmp_path / "base.yaml").write_text(textwrap.dedent("""\
        output_dir: out
        total_steps: 2
        data: {train: x.jsonl}
        rewards: {components: [{name: accuracy}, {name: tag_format}]}
        rollout: {group_size: 4, temperature: 0.7}
        """))
    child = tmp_path / "sub" / "child.yaml"
    child.parent.mkdir()
    child.write_text("extends: ../base.yaml\nrollout: {group_size: 2}\nrewards: {components: [{name: accuracy}]}\n")
    cfg = load_config(child, ["rollout.temperature=0.5"])
    assert (cfg.rollout.group_size, cfg.rollout.temperature, cfg.total_steps) == (2, 0.5, 2)  # mappings merged
    assert [c.name for c in cfg.rewards.components] == ["accuracy"]  # lists replaced
    (tmp_path / "base.yaml").write_text((tmp_path / "base.yaml").read_text().replace("steps: 2", "steps: many"))
    with pytest.raises(ConfigError, match=r"child.yaml: invalid config\n  total_steps \(line 2 of .*base.yaml\)"):
        load_config(child)
    child.write_text("extends: ../base.yaml\ntotal_steps: -1\n")
    with pytest.raises(ConfigError, match=r"total_steps \(line 2\)"):
        load_config(child)


def test_an_extends_cycle_fails_naming_the_files(tmp_path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\noutput_dir: out\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ConfigError, match=r"extends cycle: .*a.yaml -> .*b.yaml -> .*a.yaml"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "b.yaml").write_text("extends: missing.yaml\n")
    with pytest.raises(ConfigError, match=r"b.yaml: extends .*missing.yaml: cannot read config"):
        load_config(tmp_path / "a.yaml")

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


def test_a_config_that_sets_the_grammar_s_top_k_is_told_where_it_moved(tmp_path):
    """Documents per query are one setting, retrieval.search.top_k: the key the grammar once had fails, naming both."""
    with pytest.raises(ConfigError, match=r"rollout.grammar \(line \d+\): .*top_k is not a grammar key.*"
                                          r"retrieval.search.top_k"):
        load_config(QUICKSTART, ["rollout.grammar.top_k=3"])
    old = tmp_path / "old.yaml"  # a config written while the grammar had the key
    old.write_text(Path(QUICKSTART).read_text().replace("max_observation_tokens: 96}", "max_observation_tokens: 96, "
                                                                                       "top_k: 3}"))
    with pytest.raises(ConfigError, match=r"rollout.grammar \(line \d+\).*top_k is not a grammar key"):
        load_config(old)


@pytest.mark.parametrize("overrides, field", [
    # no environment call: the first <query> ends the episode before any answer
    (["rollout.grammar.max_turns=0"], r"rollout.grammar.max_turns 0 allows no environment call"),
    (["eval={data: [hpo:mcq_test], max_turns: 0}"], r"eval.max_turns 0 allows no environment call"),
    # tiny: 24-token turns, 96-token observations: a search and an answer need 144 response tokens
    (["rollout.grammar.max_response_tokens=120"], r"rollout.grammar.max_response_tokens 120 .* need 144"),
    # 384 prompt tokens + 256 response tokens do not fit a 512-token context
    (["rollout.max_model_len=512"], r"rollout.max_model_len 512 .*data.max_prompt_tokens 384.* raise it to 640"),
    # 400-character passages take at least 50 tokens each: a 40-token observation cuts every one
    (["retrieval.show=passages", "retrieval.passage_chars=400", "rollout.grammar.max_observation_tokens=40"],
     r"rollout.grammar.max_observation_tokens 40 cuts every hit: .*retrieval.passage_chars 400"),
])
def test_a_budget_the_environment_cannot_honour_fails_at_config_time_naming_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field):
        load_config(QUICKSTART, overrides)


def test_budgets_that_fit_load_and_a_single_turn_run_needs_no_environment_call():
    load_config(QUICKSTART, ["rollout.grammar.max_response_tokens=144", "retrieval.show=passages",
                             "retrieval.passage_chars=400", "rollout.grammar.max_observation_tokens=50"])
    single = load_config(QUICKSTART, ["rollout.grammar.action_tag=null", "retrieval=null",
                                      "rollout.grammar.max_turns=0", "rollout.max_model_len=408"])  # 384 + 24 tokens
    assert single.rollout.grammar.max_turns == 0


def test_a_stage_that_breaks_a_budget_is_refused_naming_the_stage(tmp_path):
    path = tmp_path / "staged.yaml"
    path.write_text(open(QUICKSTART).read() + textwrap.dedent("""\
        stages:
          - {name: warm, steps: 60}
          - {name: late, steps: 60, set: {rollout.max_new_tokens: 100}}
        """))
    with pytest.raises(ConfigError, match=r"stages\[1\] \(late\).*max_response_tokens 256 cannot hold"):
        load_config(path)


def test_a_token_budget_below_the_longest_sequence_and_a_correction_cap_of_one_are_refused():
    with pytest.raises(ConfigError, match=r"learner.max_tokens_per_micro_batch 512 is smaller than the longest "
                                          r"sequence a rollout can make \(rollout.max_model_len 1024\)"):
        load_config("configs/quickstart.yaml", ["learner.max_tokens_per_micro_batch=512"])
    with pytest.raises(ConfigError, match=r"algorithm.rollout_correction.cap \(command-line override\)"):
        load_config(QUICKSTART, ["algorithm.rollout_correction.kind=tis", "algorithm.rollout_correction.cap=1.0"])
    with pytest.raises(ConfigError, match=r"algorithm.rollout_correction.kind"):
        load_config(QUICKSTART, ["algorithm.rollout_correction.kind=clip"])
    cfg = load_config(QUICKSTART, ["learner.max_tokens_per_micro_batch=4096", "algorithm.rollout_correction.kind=mis"])
    assert cfg.learner.max_tokens_per_micro_batch == 4096 and cfg.algorithm.rollout_correction.cap == 2.0


def test_the_objective_is_chosen_by_name_and_an_unknown_one_is_refused_naming_the_choices():
    cfg = load_config(QUICKSTART, ["algorithm.advantage=rloo", "algorithm.ratio_level=sequence"])
    assert (cfg.algorithm.advantage, cfg.algorithm.ratio_level) == ("rloo", "sequence")
    with pytest.raises(ConfigError, match=r"algorithm.advantage \(command-line override\): Input should be 'grpo', "
                                          r"'rloo' or 'reinforce_pp'"):
        load_config(QUICKSTART, ["algorithm.advantage=ppo"])
    with pytest.raises(ConfigError, match=r"algorithm.ratio_level \(command-line override\): Input should be 'token' "
                                          r"or 'sequence'"):
        load_config(QUICKSTART, ["algorithm.ratio_level=seq"])
    with pytest.raises(ConfigError, match=r"algorithm \(line \d+\).*normalize_std: false \(Dr.GRPO\) is a setting of "
                                          r"advantage grpo"):
        load_config(QUICKSTART, ["algorithm.advantage=reinforce_pp", "algorithm.normalize_std=false"])
    with pytest.raises(ConfigError, match=r"algorithm.advantage rloo .* needs rollout.group_size >= 2"):
        load_config(QUICKSTART, ["algorithm.advantage=rloo", "rollout.group_size=1"])

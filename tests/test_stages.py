"""Multi-stage runs and the SFT objective: stage configs, demonstrations and the loss, without starting actors."""
import json
import textwrap

import pytest
import torch

from learners.algorithm import sft_loss
from learners.config import ConfigError, load_config
from learners.data import demonstration_trajectory, read_demonstrations
from tasks.schema import TaskFormatError

BASE = """\
    output_dir: out
    total_steps: 5
    data: {train: hpo:mcq_train}
    rewards: {components: [{name: accuracy}]}
    """


def config(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent(BASE) + textwrap.dedent(text))
    return path


def test_stages_override_their_sections_and_nothing_else(tmp_path):
    cfg = load_config(config(tmp_path, """\
        stages:
          - {name: cold_start, kind: sft, steps: 2, sft: {data: demos.jsonl, batch_size: 8}}
          - name: rl
            steps: 3
            set: {rollout.temperature: 0.7, algorithm.normalize_std: false,
                  rewards.components: [{name: accuracy}, {name: valid_option, weight: 0.5}]}
        """))
    assert [s.name for s in cfg.stage_plan()] == ["cold_start", "rl"]
    rl = cfg.for_stage(1)
    assert rl.rollout.temperature == 0.7 and rl.algorithm.normalize_std is False
    assert [c.name for c in rl.rewards.components] == ["accuracy", "valid_option"]
    assert cfg.for_stage(0).rollout.temperature == 1.0 and cfg.rollout.temperature == 1.0  # the base is unchanged


def test_a_config_without_stages_is_one_grpo_stage(tmp_path):
    plan = load_config(config(tmp_path, "")).stage_plan()
    assert [(s.kind, s.steps) for s in plan] == [("grpo", 5)]


@pytest.mark.parametrize("stages, message", [
    ("- {name: a, steps: 2}\n", "stages last 2 steps in all but total_steps is 5"),
    ("- {name: a, steps: 5, set: {learner.zero_stage: 3}}\n", "cannot change between stages"),
    ("- {name: a, steps: 5, set: {rollout.dtype: bfloat16}}\n", "['rollout.dtype'] cannot change between stages"),
    ("- {name: a, steps: 5, kind: sft}\n", "an sft stage needs an sft section"),
    ("- {name: a, steps: 5, set: {rollout.temprature: 0.1}}\n", "stages[0] (a) set (line"),
    ("- {name: a, steps: 5, set: {rollout.grammar.action_tag: query}}\n", "needs an environment"),
])
def test_bad_stages_are_refused_naming_the_stage(tmp_path, stages, message):
    with pytest.raises(ConfigError) as e:
        load_config(config(tmp_path, "stages:\n" + textwrap.indent(stages, "  ")))
    assert message in str(e.value)


def test_sft_loss_is_token_mean_nll_over_the_mask():
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.1], [0.8, 0.5, 0.5]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 0.0]])
    loss, stats = sft_loss(logp, mask)
    # -(ln 0.5 + ln 0.25 + ln 0.5) / 3 = (0.6931 + 1.3863 + 0.6931) / 3
    assert loss.item() == pytest.approx(0.924196, abs=1e-5)
    assert stats["mask_sum"] == 3
    half, _ = sft_loss(logp, mask, global_denominator=6)  # a micro-batch holding half the batch's tokens
    assert half.item() == pytest.approx(0.924196 / 2, abs=1e-5)


def demo(segments):
    return {"task": {"id": "t", "messages": [{"role": "user", "content": "Tall with lens dislocation?"}]},
            "segments": segments}


def test_demonstration_masks_train_only_on_the_policy(tiny_model_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    segments = [{"role": "policy", "text": "<think>lens</think><query>lens dislocation</query>"},
                {"role": "environment", "text": "\n<retrieve>\n[1] Marfan syndrome: tall\n</retrieve>\n"},
                {"role": "policy", "text": "<answer>A</answer>"}]
    traj = demonstration_trajectory(demo(segments), tok, group=0)
    pieces = [tok.encode(s["text"], add_special_tokens=False) for s in segments]
    assert traj.response_ids == pieces[0] + pieces[1] + pieces[2]
    assert traj.loss_mask == [1] * len(pieces[0]) + [0] * len(pieces[1]) + [1] * len(pieces[2])
    assert tok.decode(traj.prompt_ids).endswith("assistant\n")


def test_malformed_demonstrations_name_file_line_and_field(tmp_path):
    path = tmp_path / "demos.jsonl"
    good = json.dumps(demo([{"role": "policy", "text": "<answer>A</answer>"}]))
    path.write_text(good + "\n" + json.dumps(demo([{"role": "narrator", "text": "x"}])) + "\n")
    with pytest.raises(TaskFormatError, match=r"demos.jsonl:2: field 'segments.0'"):
        read_demonstrations(path)
    path.write_text(good + "\n{oops\n")
    with pytest.raises(TaskFormatError, match=r"demos.jsonl:2: invalid JSON"):
        read_demonstrations(path)
    path.write_text(good + "\n")
    assert len(read_demonstrations(path)) == 1


def test_representative_questions_come_from_frequent_answers_nearest_their_centroids():
    import numpy as np

    from recipes.armed import representative_tasks
    answers = ["gout", "gout", "gout", "gout", "asthma", "asthma", "asthma", "rare"]
    # two tight clusters among the gout/asthma questions; 'rare' (frequency 1 <= tau) is never chosen
    points = np.array([[0, 0], [0.1, 0], [5, 5], [5.1, 5], [0, 0.1], [0.05, 0.05], [5, 5.1], [0, 0]], float)
    chosen = representative_tasks(answers, points, min_frequency=1, clusters=2, seed=0)
    assert len(chosen) == 2 and 7 not in chosen
    assert {tuple(points[i] > 2) for i in chosen} == {(False, False), (True, True)}  # one per cluster
    # the one nearest the centroid of the low cluster {0, 1, 4, 5} (centroid 0.0375, 0.0375) is question 5
    assert 5 in chosen
    with pytest.raises(ValueError, match="min_answer_frequency"):
        representative_tasks(answers, points, min_frequency=4, clusters=2)


def test_demonstrations_from_rollouts_keep_segments_and_anchor_the_gold_answer(tiny_model_path):
    from transformers import AutoTokenizer

    from actors.trajectory import Trajectory
    from recipes.armed import anchored_segments, segments_of
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    policy, env, answer = (tok.encode(t, add_special_tokens=False) for t in
                           ("<think>tall</think><query>tall</query>", "<retrieve>Marfan</retrieve>",
                            "<answer>B</answer>"))
    traj = Trajectory(task={}, group=0, prompt_ids=[1], response_ids=policy + env + answer, logprobs=[],
                      loss_mask=[1] * len(policy) + [0] * len(env) + [1] * len(answer), text="",
                      finish_reason="stop", weight_version=0)
    segments = segments_of(traj, tok)
    assert [s["role"] for s in segments] == ["policy", "environment", "policy"]
    assert segments[1]["text"] == "<retrieve>Marfan</retrieve>"
    anchored = anchored_segments(segments, "A")
    assert anchored[-1]["text"] == "<answer>A</answer>" and anchored[:2] == segments[:2]


def test_a_recipe_checks_the_settings_of_its_demonstration_source():
    cfg = load_config("configs/armed.yaml")
    assert [s.sft.args for s in cfg.stages if s.sft] == [{"clusters": 32, "samples": 4, "min_answer_frequency": 1}]
    with pytest.raises(ConfigError, match=r"stage 'inject': sft.args.clusters: Input should be greater"):
        load_config("configs/armed.yaml", ["stages.1.sft.args.clusters=0"])
    with pytest.raises(ConfigError, match=r"sft.args set the recipe's demonstration sources \['self'\]"):
        load_config("configs/armed.yaml", ["stages.1.sft.data=demos.jsonl"])

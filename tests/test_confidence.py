"""Med-RwR's confidence gain: which sequences are probed (recipes/med_rwr.py), and the reward from their
log-probabilities."""
import math

import pytest

from actors.trajectory import Trajectory
from learners.config import load_config
from recipes import load_recipe
from recipes.med_rwr import AnswerProbe, answer_probe_sequences, gold_as_written
from rewards.confidence import confidence_gain

ANSWER, GOLD = 7, 42


def test_probes_keep_or_drop_exactly_the_environment_tokens():
    prompt = [1, 2]
    response = [10, 11, 90, 91, 92, 12, ANSWER, 30]   # policy 10 11, retrieved 90-92, policy 12 <answer> A
    mask = [1, 1, 0, 0, 0, 1, 1, 1]
    with_k, without_k = answer_probe_sequences(prompt, response, mask, [ANSWER], [GOLD])
    assert with_k == [1, 2, 10, 11, 90, 91, 92, 12, ANSWER, GOLD]
    assert without_k == [1, 2, 10, 11, 12, ANSWER, GOLD]


def test_no_probe_without_retrieval_or_without_an_answer():
    assert answer_probe_sequences([1], [10, ANSWER, 30], [1, 1, 1], [ANSWER], [GOLD]) is None  # nothing retrieved
    assert answer_probe_sequences([1], [10, 90, 11], [1, 0, 1], [ANSWER], [GOLD]) is None       # never answered
    # an <answer> token inside retrieved text is not the policy's
    assert answer_probe_sequences([1], [10, ANSWER, 11], [1, 0, 1], [ANSWER], [GOLD]) is None


def test_a_tag_of_several_tokens_is_found_where_the_policy_wrote_it_last():
    """A real tokenizer spells `<answer>` as '<', 'answer', '>' (SmolLM2): the probe goes after the last one."""
    tag = [5, 6, 7]
    response = [5, 6, 7, 30, 90, 91, 12, 5, 6, 7, 31]   # an early <answer>, retrieved 90-91, then <answer> again
    mask = [1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1]
    with_k, without_k = answer_probe_sequences([1], response, mask, tag, [GOLD])
    assert with_k == [1, 5, 6, 7, 30, 90, 91, 12, 5, 6, 7, GOLD]
    assert without_k == [1, 5, 6, 7, 30, 12, 5, 6, 7, GOLD]
    assert answer_probe_sequences([1], [10, 5, 6, 11], [1, 0, 1, 1], tag, [GOLD]) is None  # no whole tag


def test_a_gold_answer_of_several_tokens_is_probed_whole():
    with_k, without_k = answer_probe_sequences([1], [10, 90, 12, ANSWER, 30], [1, 0, 1, 1, 1], [ANSWER], [42, 43])
    assert with_k == [1, 10, 90, 12, ANSWER, 42, 43] and without_k == [1, 10, 12, ANSWER, 42, 43]


def test_the_gold_answer_is_probed_in_the_form_the_policy_answers_in():
    """A policy that answers with the option's text (reading passages) is probed for the gold option's text: p(letter)
    after its `<answer>` says nothing about what it is about to write."""
    task = {"answer": "B", "options": {"A": "Marfan syndrome", "B": "Jawad syndrome"}}
    assert gold_as_written(task, "B") == gold_as_written(task, "Option b") == "B"
    assert gold_as_written(task, "Marfan syndrome") == "Jawad syndrome"  # a wrong option's text
    assert gold_as_written(task, "Ehlers-Danlos syndrome") == "Jawad syndrome"  # no option's text
    assert gold_as_written(task, None) == "B"
    assert gold_as_written({"answer": "cystic fibrosis"}, "asthma") == "cystic fibrosis"  # open-ended: as given


def traj(answer_logprobs):
    return Trajectory(task={}, group=0, prompt_ids=[], response_ids=[], logprobs=[], loss_mask=[], text="",
                      finish_reason="stop", weight_version=0, answer_logprobs=answer_logprobs)


def test_confidence_gain_is_the_log_ratio():
    # p(gold) rose from 0.25 without the retrieved text to 0.5 with it: sigma_c = ln 2
    scores = confidence_gain([traj({"with": math.log(0.5), "without": math.log(0.25)}), traj({})])
    assert scores["confidence_gain"] == pytest.approx([math.log(2), 0.0])  # probed, nothing retrieved: 0


def test_confidence_gain_refuses_trajectories_no_probe_has_seen():
    """A run that rewards confidence gain without the med_rwr recipe (which reads the answer log-probabilities) is
    told so, instead of training on a reward that is silently 0."""
    with pytest.raises(ValueError, match="recipe: med_rwr"):
        confidence_gain([traj({}), traj(None)])


def test_only_stages_that_reward_it_pay_for_the_probes():
    cfg = load_config("configs/med_rwr.yaml")  # stage text: format + accuracy; stage multimodal adds confidence gain
    recipe = load_recipe(cfg.recipe)
    hooks = [recipe.rollout_hooks(cfg.for_stage(i)) for i in range(len(cfg.stage_plan()))]
    assert hooks[0] == [] and [type(h) for h in hooks[1]] == [AnswerProbe]

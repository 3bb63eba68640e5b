"""Shared reward state has one owner per run: however many reward actors score a step's shares, ARMed's Adapt
thresholds are updated once, by RewardActor-0, from the whole batch, as one Adapt fed the whole batch would be."""
import pytest

from actors.trajectory import Trajectory
from rewards.adaptive import Adapt

REF = "lesion in the left lung"
ANSWERS = ["lesion in the left lung", "left lung nodule", "pneumonia", "no finding", "right lung lesion",
           "a lesion of the lung", "cardiomegaly", "left lung opacity", "normal chest"]
SPECS = [{"name": "armed_semantic", "weight": 1.0, "args": {"adaptive": True, "adapt": {"max_step": 0.2}}}]


def share(answers, first_group):
    return [Trajectory(task={"id": "t", "answer": REF, "options": None, "references": [REF], "metadata": {}},
                       group=first_group + i // 3, prompt_ids=[], response_ids=[], logprobs=[], loss_mask=[],
                       text=f"<think>x</think><answer>{a}</answer>", finish_reason="stop", weight_version=0)
            for i, a in enumerate(answers)]


def test_two_reward_actors_update_the_adaptive_thresholds_once_from_the_whole_batch(ray_session):
    import ray

    from rewards.reward_actor import RewardActor
    from rewards.semantic import load_bertscore, load_encoder

    actors = [RewardActor.remote(SPECS, 120.0, "fail") for _ in range(2)]
    shares = [share(ANSWERS[0:3], 0), share(ANSWERS[3:6], 1), share(ANSWERS[6:9], 2)]
    assert ray.get(actors[0].stateful.remote())
    scores = ray.get([actors[i % 2].score.remote(s) for i, s in enumerate(shares)])  # actor 0 scores two shares
    calibrated = ray.get(actors[0].calibrate.remote(scores))

    bert = load_bertscore(None, None, None, 64).f1(ANSWERS, [REF] * 9)
    cos = load_encoder(None, 64).cosine(ANSWERS, [REF] * 9)
    streams = {"bertscore": Adapt(max_step=0.2), "cos_sim": Adapt(max_step=0.2)}
    expected = [0.2 * b + 0.8 * c for b, c in zip(streams["bertscore"](bert), streams["cos_sim"](cos))]
    got = [v for s in calibrated for v in s["components"]["armed_semantic"]]
    assert got == pytest.approx(expected, abs=1e-5)
    assert [v for s in calibrated for v in s["total"]] == pytest.approx(expected, abs=1e-5)

    owner, other = ray.get([a.state_dict.remote() for a in actors])
    for name, stream in streams.items():
        assert owner["0:armed_semantic"][name]["threshold"] == pytest.approx(stream.threshold)
        assert len(owner["0:armed_semantic"][name]["history"]) == len(stream.history)
    assert other["0:armed_semantic"]["bertscore"] == {"threshold": 0.5, "history": []}, \
        "the second actor keeps no state of its own"
    for actor in actors:
        ray.kill(actor)

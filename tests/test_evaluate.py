"""The evaluation harness: its metrics by hand and against the libraries, and a real run on rollout workers."""
import pytest
from rouge_score.rouge_scorer import RougeScorer
from sacrebleu.metrics import BLEU

from actors.trajectory import Trajectory
from learners.evaluate import score, wilson_interval

SUMMARY = {"env_calls": 0, "env_errors": 0}


def traj(answer: str, task: dict) -> Trajectory:
    return Trajectory(task=task, group=0, prompt_ids=[1], response_ids=[5, 6], logprobs=[0, 0], loss_mask=[1, 1],
                      text=f"<think>x</think><answer>{answer}</answer>", finish_reason="stop", weight_version=0)


def test_wilson_interval_by_hand():
    low, high = wilson_interval(8, 10)
    # p = 0.8, n = 10, z = 1.96: centre (0.8 + 0.19208) / 1.38416 = 0.71675, half 0.22606
    assert (low, high) == pytest.approx((0.4902, 0.9433), abs=1e-4)


def test_multiple_choice_accuracy():
    task = {"answer": "B", "options": {"A": "Gout", "B": "Marfan syndrome"}, "references": []}
    metrics = score([traj("B", task), traj("A", task), traj("Marfan syndrome", task)], [SUMMARY])
    assert metrics["accuracy"]["mean"] == pytest.approx(2 / 3) and metrics["accuracy"]["n"] == 3


def test_open_ended_metrics_equal_the_libraries():
    pairs = [("marfan syndrome", "Marfan syndrome"), ("tall stature with lens dislocation", "Marfan syndrome type 1")]
    trajs = [traj(a, {"answer": g, "options": None, "references": []}) for a, g in pairs]
    metrics = score(trajs, [SUMMARY])
    bleu = BLEU(max_ngram_order=1, lowercase=True, effective_order=True)
    rouge = RougeScorer(["rouge1"])
    expected_bleu = sum(bleu.sentence_score(a, [g]).score / 100 for a, g in pairs) / 2
    expected_rouge = sum(rouge.score(g, a)["rouge1"].fmeasure for a, g in pairs) / 2
    assert metrics["bleu1"]["mean"] == pytest.approx(expected_bleu)
    assert metrics["rouge1"]["mean"] == pytest.approx(expected_rouge)
    assert 0 < metrics["cos_sim"]["mean"] <= 1 and 0 < metrics["bertscore"]["mean"] <= 1


@pytest.mark.slow
def test_evaluate_a_checkpoint_through_rollout_workers(ray_session, tiny_model_path):
    from learners.config import load_config
    from learners.evaluate import evaluate
    cfg = load_config("configs/tiny.yaml", ["output_dir=unused"])
    metrics = evaluate(cfg, str(tiny_model_path), "hpo:mcq_test", limit=8)
    assert metrics["n"] == 8 and metrics["accuracy"]["n"] == 8
    assert 0 <= metrics["accuracy"]["low"] <= metrics["accuracy"]["mean"] <= metrics["accuracy"]["high"] <= 1

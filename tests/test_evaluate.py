"""The evaluation harness: its metrics by hand and against the libraries, and a real run on rollout workers."""
import pytest
from rouge_score.rouge_scorer import RougeScorer
from sacrebleu.metrics import BLEU

from actors.trajectory import Trajectory
from learners.evaluate import score
from learners.intervals import wilson_interval

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


def test_closed_questions_are_scored_by_exact_match_not_similarity():
    closed = {"answer": "No", "options": None, "references": ["No"], "metadata": {"answer_type": "closed"}}
    metrics = score([traj("no.", closed), traj("Yes", closed), traj("No", closed)], [SUMMARY])
    assert metrics["closed_accuracy"]["mean"] == pytest.approx(2 / 3) and metrics["closed_accuracy"]["n"] == 3
    assert (metrics["closed_accuracy"]["low"], metrics["closed_accuracy"]["high"]) == pytest.approx(wilson_interval(2, 3))
    assert "bleu1" not in metrics and "accuracy" not in metrics


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


def a_run_with_checkpoints(root, model_path, steps):
    """A run's checkpoints/ as training leaves it: step_<N> directories and `latest` pointing at the newest."""
    import os
    import shutil
    checkpoints = root / "run" / "checkpoints"
    for step in steps:
        shutil.copytree(model_path, checkpoints / f"step_{step}")
    os.symlink(f"step_{steps[-1]}", checkpoints / "latest")
    return checkpoints


@pytest.mark.slow
def test_evaluate_a_checkpoint_through_rollout_workers(ray_session, tiny_model_path, tmp_path):
    """`python -m learners.evaluate` on checkpoints/latest: the report lands beside the run's checkpoints, named by
    the step, and outlives the checkpoint when rotation deletes it."""
    import json
    import shutil

    from learners.evaluate import main
    checkpoints = a_run_with_checkpoints(tmp_path, tiny_model_path, [2])
    assert main(["--config", "configs/tiny.yaml", "--checkpoint", str(checkpoints / "latest"), "--data",
                 "hpo:mcq_test", "--limit", "8"]) == 0
    report = tmp_path / "run" / "eval" / "checkpoints" / "step_2" / "hpo_mcq_test"
    metrics = json.loads((report / "eval.json").read_text())
    assert metrics["n"] == 8 and metrics["accuracy"]["n"] == 8
    assert 0 <= metrics["accuracy"]["low"] <= metrics["accuracy"]["mean"] <= metrics["accuracy"]["high"] <= 1
    assert len((report / "samples.jsonl").read_text().splitlines()) == 8
    # nothing was written into the checkpoint
    assert {p.name for p in (checkpoints / "step_2").iterdir()} == {p.name for p in tiny_model_path.iterdir()}
    shutil.rmtree(checkpoints / "step_2")  # what checkpoint.keep_last does to an old step
    assert json.loads((report / "eval.json").read_text()) == metrics


def test_a_checkpoints_evaluation_is_written_outside_it(tmp_path, tiny_model_path):
    from learners.config import load_config
    from learners.evaluate import default_out
    from learners.validation import evaluated_steps

    cfg = load_config("configs/tiny.yaml", [f"output_dir={tmp_path / 'elsewhere'}"])
    checkpoints = a_run_with_checkpoints(tmp_path, tiny_model_path, [10, 20])
    run = tmp_path / "run"
    assert default_out(cfg, str(checkpoints / "latest"), "hpo:mcq_test") == \
        run / "eval" / "checkpoints" / "step_20" / "hpo_mcq_test"
    assert default_out(cfg, str(checkpoints / "step_10"), "cases/held_out.jsonl") == \
        run / "eval" / "checkpoints" / "step_10" / "held_out"
    # a model directory outside any run: under the config's output_dir
    assert default_out(cfg, str(tiny_model_path), "hpo:mcq_test") == \
        tmp_path / "elsewhere" / "eval" / "checkpoints" / tiny_model_path.name / "hpo_mcq_test"
    # and never where the run's own evaluations (and its closing report) look
    default_out(cfg, str(checkpoints / "latest"), "hpo:mcq_test").mkdir(parents=True)
    assert evaluated_steps(run) == []


def test_evaluations_inside_a_run_are_due_at_every_n_and_at_the_end(tmp_path, tiny_model_path):
    from learners.config import load_config
    from learners.validation import Validator, weights_label

    cfg = load_config("configs/quickstart.yaml", ["output_dir=unused", "eval.every=4", "eval.limit=2"])
    validator = Validator(cfg, tmp_path, str(tiny_model_path))
    total = cfg.total_steps
    assert [s for s in range(1, total + 1) if validator.due(s)] == [s for s in range(4, total, 4)] + [total]
    assert len(validator.splits["hpo:mcq_test"]) == 2
    cold = cfg.stages[0].steps
    assert [weights_label(cfg, s) for s in (0, 1, cold, total)] == \
        ["base", "cold_start step 1", "after cold_start", "after grpo"]


def test_the_closing_report_lists_every_evaluation_of_the_run(tmp_path):
    import json

    from learners.config import load_config
    from learners.validation import closing_report

    cfg = load_config("configs/quickstart.yaml", [f"output_dir={tmp_path}"])
    assert closing_report(cfg, tmp_path) is None
    for step, (correct, formatted) in {0: (0, 0.0), cfg.total_steps: (120, 0.99)}.items():
        where = tmp_path / "eval" / f"step_{step}" / "hpo_mcq_test"
        where.mkdir(parents=True)
        low, high = wilson_interval(correct, 150)
        (where / "eval.json").write_text(json.dumps({
            "n": 150, "accuracy": {"mean": correct / 150, "low": low, "high": high, "n": 150},
            "format_rate": {"mean": formatted}, "env_calls_per_sample": 1.0 if step else 0.0,
            "gold_retrieved": {"mean": 0.8}}))
    report = closing_report(cfg, tmp_path)
    assert "| hpo:mcq_test | base (step 0) | 0.0% [0.0%, 2.5%] | 0.0% | 0.00 | 80.0% | 150 |" in report
    assert f"| hpo:mcq_test | after grpo (step {cfg.total_steps}) | 80.0% [72.9%, 85.6%] | 99.0% | 1.00 |" in report
    assert (tmp_path / "eval.md").read_text() == report


def test_evaluation_can_cap_the_turns_training_allowed():
    from learners.config import load_config
    from learners.evaluate import eval_grammar

    grammar = {"action_tag": "tool_call", "max_turns": 6}
    medvr = load_config("configs/medvr_cluster.yaml")
    assert medvr.eval.max_turns == 4 and eval_grammar(medvr, grammar) == {"action_tag": "tool_call", "max_turns": 4}
    assert eval_grammar(load_config("configs/quickstart.yaml"), grammar) == grammar

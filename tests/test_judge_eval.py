"""Judge-graded accuracy of open questions at evaluation (learners/judge_eval.py).

- the verdict parser and the counts with their Wilson interval, by hand (no Ray);
- a real JudgeActor (openai backend, the stock client) against the scripted chat server of test_judge on loopback:
  only open questions reach the judge, and correct, incorrect, unanswered and unparsable verdicts are each counted;
- slow: the tiny vLLM judge (its verdicts are arbitrary, so the counting contract) and learners.evaluate --judge end
  to end on the tiny policy.
"""
import json

import pytest
from test_judge import chat_server  # noqa: F401  (the scripted OpenAI-compatible server fixture)

from actors.judge import JudgeActor, parse_verdict
from actors.trajectory import Trajectory
from learners.config import ConfigError, load_config
from learners.evaluate import open_questions
from learners.intervals import wilson_interval
from learners.judge_eval import judge_open_answers, verdict_counts


def traj(answer: str | None, gold: str, question: str, options=None, answer_type=None) -> Trajectory:
    task = {"id": question, "messages": [{"role": "user", "content": question}], "answer": gold, "options": options,
            "references": [], "metadata": {"answer_type": answer_type} if answer_type else {}}
    text = "<think>x</think>" + (f"<answer>{answer}</answer>" if answer is not None else "")
    return Trajectory(task=task, group=0, prompt_ids=[1], response_ids=[5, 6], logprobs=[0, 0], loss_mask=[1, 1],
                      text=text, finish_reason="stop", weight_version=0)


def test_verdict_parser_is_strict():
    assert parse_verdict("The meaning matches.\nCorrect") is True
    assert parse_verdict("Verdict: **incorrect**.") is False
    assert parse_verdict("INCORRECT") is False
    for text in ("", "correct-ish", "It is correct", "correct\nbecause the reference says so", "yes"):
        assert parse_verdict(text) is None, text


def test_verdict_counts_put_every_open_question_in_the_denominator():
    got = verdict_counts(6, [True, True, False, None])  # 2 open questions had no <answer>
    low, high = wilson_interval(2, 6)
    assert got == {"judge_accuracy": {"mean": 2 / 6, "low": low, "high": high, "n": 6, "correct": 2,
                                      "incorrect": 1, "unanswered": 2, "parse_failures": 1},
                   "judge_parse_failures": 1}


def test_eval_judge_needs_a_judge_section():
    with pytest.raises(ConfigError, match="eval.judge needs a `judge` section"):
        load_config("configs/quickstart.yaml", ["eval.judge=true"])
    assert load_config("configs/med_r3.yaml", ["eval.data=[hpo:open_test]", "eval.judge=true"]).eval.judge


def scripted_verdict(content: str, times: int) -> str:
    """A judge that says correct when the answer names the gold disease, and babbles about one answer."""
    answer = content.split("Answer to judge:")[1].split("\n")[0].strip()
    reference = content.split("Reference answer:")[1].split("\n")[0].strip()
    if answer == "something unclear":
        return "I cannot decide."
    return "Both name the same disease.\nVerdict: Correct" if reference.lower() in answer.lower() else "incorrect"


def test_open_answers_graded_by_an_openai_judge(ray_session, chat_server):  # noqa: F811
    ray = ray_session
    server = chat_server(scripted_verdict)
    judge = JudgeActor.options(name="JudgeActor-eval", num_cpus=0.25).remote(
        {"backend": "openai", "base_url": server.url, "model": "judge-model", "max_retries": 1})
    try:
        mcq = traj("B", "B", "Which option?", options={"A": "Gout", "B": "Marfan syndrome"})
        closed = traj("Yes", "Yes", "Is it inherited?", answer_type="closed")
        batch = [mcq, closed,
                 traj("classic Marfan syndrome", "Marfan syndrome", "q1"),
                 traj("Gout", "Marfan syndrome", "q2"),
                 traj("something unclear", "Fabry disease", "q3"),
                 traj(None, "Fabry disease", "q4"),
                 traj("Fabry disease", "Fabry disease", "q5", answer_type="open")]
        got = judge_open_answers(open_questions(batch), judge)
        assert got["judge_accuracy"]["n"] == 5 and got["judge_accuracy"]["correct"] == 2
        assert (got["judge_accuracy"]["incorrect"], got["judge_accuracy"]["unanswered"],
                got["judge_parse_failures"]) == (1, 1, 1)
        assert (got["judge_accuracy"]["low"], got["judge_accuracy"]["high"]) == pytest.approx(wilson_interval(2, 5))
        asked = [r["messages"][-1]["content"] for r in server.requests]
        assert len(asked) == 5  # four answered open questions, and one retry of the babble
        assert {a.split("Question:\n")[1].split("\n")[0] for a in asked} == {"q1", "q2", "q3", "q5"}
        assert ray.get(judge.stats.remote())["parse_failures"] == 1
        assert judge_open_answers(open_questions([mcq, closed]), judge) == {}  # nothing open: no judge_accuracy at all
        assert len(server.requests) == 5
    finally:
        ray.kill(judge)


@pytest.mark.slow
def test_tiny_vllm_judge_counts_every_open_answer(ray_session):
    """The tiny random model's verdicts are arbitrary: each answered open question ends as correct, incorrect or a
    parse failure, and only those reach the judge."""
    ray = ray_session
    judge = JudgeActor.options(name="JudgeActor-eval-vllm", num_cpus=0.5).remote(
        {"backend": "vllm", "max_tokens": 8, "max_retries": 1, "max_model_len": 1024, "kv_cache_gb": 0.25})
    try:
        batch = [traj(f"answer {i}", "Marfan syndrome", f"q{i}") for i in range(5)] + \
            [traj(None, "Marfan syndrome", "q5"), traj("A", "A", "mcq", options={"A": "x", "B": "y"})]
        got = judge_open_answers(open_questions(batch), judge)["judge_accuracy"]
        assert got["n"] == 6 and got["unanswered"] == 1
        assert got["correct"] + got["incorrect"] + got["parse_failures"] == 5
        assert 0 <= got["low"] <= got["mean"] <= got["high"] <= 1
        stats = ray.get(judge.stats.remote())
        assert stats["prompts"] == 5 and stats["parse_failures"] == got["parse_failures"]
    finally:
        ray.kill(judge)


@pytest.mark.slow
def test_evaluate_with_the_judge_on_open_questions(ray_session, tiny_model_path, tmp_path):
    from learners.evaluate import main
    out = tmp_path / "eval"
    assert main(["--config", "configs/med_r3.yaml", "--checkpoint", str(tiny_model_path), "--data", "hpo:open_test",
                 "--limit", "4", "--out", str(out), "--judge", "judge.max_tokens=8",
                 "output_dir=unused"]) == 0
    report = json.loads((out / "eval.json").read_text())
    judged = report["judge_accuracy"]
    assert judged["n"] == 4 == report["bleu1"]["n"] and "accuracy" not in report
    assert judged["correct"] + judged["incorrect"] + judged["parse_failures"] + judged["unanswered"] == 4
    assert report["judge_parse_failures"] == judged["parse_failures"]
    assert "| judge_accuracy |" in (out / "eval.md").read_text()

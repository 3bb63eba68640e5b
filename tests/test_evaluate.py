"""The evaluation harness: its metrics by hand and against the libraries, and a real run on rollout workers."""
import pytest
from rouge_score.rouge_scorer import RougeScorer
from sacrebleu.metrics import BLEU

from actors.trajectory import RolloutSummary, Trajectory
from learners.evaluate import score
from learners.intervals import wilson_interval

#: one share's summary of episodes that called no environment
SUMMARY = RolloutSummary(lengths=[], finish_reasons=[], policy_tokens=0, env_calls=0, env_errors=0, idle_s=0.0,
                         seconds=0.0, version=0, peak_memory_gb={})


def traj(answer: str, task: dict) -> Trajectory:
    return Trajectory(task=task, group=0, prompt_ids=[1], response_ids=[5, 6], logprobs=[0, 0], loss_mask=[1, 1],
                      text=f"<think>x</think><answer>{answer}</answer>", finish_reason="stop", weight_version=0)


def test_wilson_interval_by_hand():
    low, high = wilson_interval(8, 10)
    # p = 0.8, n = 10, z = 1.96: centre (0.8 + 0.19208) / 1.38416 = 0.71675, half 0.22606
    assert (low, high) == pytest.approx((0.4902, 0.9433), abs=1e-4)


@pytest.mark.parametrize("successes,n", [(0, 11), (6, 6), (21, 21), (0, 300), (300, 300)])
def test_wilson_interval_holds_an_accuracy_of_zero_or_one(successes, n):
    # an error bar drawn from it must never be negative (matplotlib refuses one)
    low, high = wilson_interval(successes, n)
    assert low <= successes / n <= high


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


def test_evaluations_inside_a_run_are_due_at_every_n_at_each_stage_end_and_at_the_end(tmp_path, tiny_model_path):
    from learners.config import load_config
    from learners.validation import Validator, weights_label

    cfg = load_config("configs/quickstart.yaml", ["output_dir=unused", "eval.every=4", "eval.limit=2"])
    validator = Validator(cfg, tmp_path, str(tiny_model_path))
    total, cold = cfg.total_steps, cfg.stages[0].steps
    # the quickstart's eval.at_stage_end: right after the cold start too
    assert [s for s in range(1, total + 1) if validator.due(s)] == sorted({*range(4, total, 4), cold, total})
    assert len(validator.splits["hpo:mcq_test"]) == 2
    plain = Validator(load_config("configs/quickstart.yaml", ["output_dir=unused", "eval.limit=1"]), tmp_path,
                      str(tiny_model_path))
    assert [s for s in range(1, total + 1) if plain.due(s)] == [cold, total]
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


def searched(answer: str, linked: list[list[str]] | None) -> Trajectory:
    """A multiple-choice episode (gold B) whose searches' hits were marked with the options `linked`, turn by turn
    (None: searches without option links, as with retrieval.link_options off)."""
    episode = traj(answer, {"answer": "B", "options": {"A": "Gout", "B": "Marfan syndrome", "C": "Rickets"}})
    episode.turns = [{"query": "q", "chunks": [], **({"linked": letters} if linked is not None else {})}
                     for letters in (linked or [[]])]
    return episode


def test_the_gold_option_link_rates_and_the_accuracy_split_by_the_first_search():
    from learners.evaluate import option_links

    episodes = [searched("B", [["B", "C"]]),          # linked in the first search, right
                searched("A", [["A"], ["B"]]),        # linked only in the second search, wrong
                searched("C", []),                    # never searched, wrong
                searched("B", [[]])]                  # searched, nothing linked, right
    links = option_links(episodes)
    assert (links["gold_linked"]["mean"], links["gold_linked_first"]["mean"]) == (0.5, 0.25)
    assert links["accuracy_first_linked"] == {"mean": 1.0, "low": pytest.approx(wilson_interval(1, 1)[0]),
                                              "high": pytest.approx(1.0), "n": 1}
    assert links["accuracy_first_unlinked"]["mean"] == pytest.approx(1 / 3)
    assert links["accuracy_first_unlinked"]["n"] == 3
    # a split no episode falls in is left out; without option links there is nothing to report
    assert "accuracy_first_unlinked" not in option_links(episodes[:1])
    assert option_links([searched("B", None)]) == {}
    metrics = score(episodes, [SUMMARY])
    assert metrics["gold_linked"] == links["gold_linked"] and metrics["accuracy"]["n"] == 4
    assert "gold_ranked_first" not in links


def test_how_often_the_options_ranking_put_the_gold_first_and_the_accuracy_when_it_did():
    from learners.evaluate import option_links

    episodes = [searched("B", [[]]), searched("A", [[]]), searched("C", [[]]), searched("B", [["B"]])]
    for episode, ranking in zip(episodes, (["B", "A"], ["B"], ["C", "B"])):  # the first three linked none
        episode.turns[0]["options_ranked"] = ranking
    links = option_links(episodes)
    assert (links["gold_ranked_first"]["mean"], links["gold_ranked_first"]["n"]) == (pytest.approx(2 / 3), 3)
    assert (links["accuracy_gold_ranked_first"]["mean"], links["accuracy_gold_ranked_first"]["n"]) == (0.5, 2)
    # answers B, A, C against rankings led by B, B, C: two of three named the ranking's first option
    assert (links["follows_ranking"]["mean"], links["follows_ranking"]["n"]) == (pytest.approx(2 / 3), 3)


def test_the_closing_report_says_what_the_last_stage_added_and_how_the_agent_searched(tmp_path):
    import json

    from learners.config import load_config
    from learners.intervals import proportion
    from learners.validation import closing_report, gain_summary

    cfg = load_config("configs/quickstart.yaml", [f"output_dir={tmp_path}"])
    cold, total = cfg.stages[0].steps, cfg.total_steps
    for step, correct in {0: 0, cold: 118, total: 120}.items():
        where = tmp_path / "eval" / f"step_{step}" / "hpo_mcq_test"
        where.mkdir(parents=True)
        links = {"gold_linked": proportion([True] * 115 + [False] * 35),
                 "gold_linked_first": proportion([True] * 115 + [False] * 35),
                 "accuracy_first_linked": proportion([True] * 115),
                 "accuracy_first_unlinked": proportion([True] * (correct - 115) + [False] * (150 - correct))}
        (where / "eval.json").write_text(json.dumps({
            "n": 150, "accuracy": proportion([True] * correct + [False] * (150 - correct)),
            "format_rate": {"mean": 0.99}, "env_calls_per_sample": 1.0 if step else 0.0, **(links if step else {})}))
    report = closing_report(cfg, tmp_path)
    assert "### Retrieval behaviour" in report
    assert f"| hpo:mcq_test | after cold_start (step {cold}) | 76.7% | 76.7% | 100.0% (n=115) | 8.6% (n=35) |" in report
    assert f"| hpo:mcq_test | after grpo (step {total}) | 76.7% | 76.7% | 100.0% (n=115) | 14.3% (n=35) |" in report
    assert "| base (step 0) | 0.0%" not in report.split("### Retrieval behaviour")[1]  # the base never searched
    # 118 -> 120 of 150 right: +1.3 points, each with its Wilson interval
    assert f"grpo added +1.3 points on hpo:mcq_test: 78.7% [71.4%, 84.5%] after cold_start (step {cold}) -> " \
           f"80.0% [72.9%, 85.6%] after grpo (step {total})" in report
    gain = json.loads((tmp_path / "eval.json").read_text())["last_stage_gain"]["hpo:mcq_test"]
    assert gain["points"] == pytest.approx(100 * 2 / 150) and (gain["before"]["step"], gain["after"]["step"]) == \
        (cold, total)
    assert gain_summary(tmp_path) == "grpo added +1.3 points on hpo:mcq_test: 78.7% [71.4%, 84.5%] -> " \
                                     "80.0% [72.9%, 85.6%]; "
    # without the evaluation after the cold start there is nothing to compare the final one with
    (tmp_path / "eval" / f"step_{cold}" / "hpo_mcq_test" / "eval.json").unlink()
    assert "added" not in closing_report(cfg, tmp_path) and gain_summary(tmp_path) == ""


def test_a_search_records_which_options_its_hits_were_marked_with():
    from actors.episode import Episode
    from actors.retrieval_env import RetrievalEnvironment

    task = {"answer": "B", "options": {"A": "Gout", "B": "Marfan syndrome"}}
    hits = [{"id": f"c{i}", "doc_id": f"d{i}", "title": title, "text": "..."}
            for i, title in enumerate(["Rickets", "marfan  Syndrome", "Gout"])]
    episode = Episode(task=task, group=0, seed=0, prompt_ids=[1])
    shown = RetrievalEnvironment(None, top_k=3, show="titles", link_options=True).observe(episode, "q", hits, None)
    assert shown.record["linked"] == ["B", "A"] and "[2] marfan  Syndrome (option B)" in shown.text
    unlinked = RetrievalEnvironment(None, top_k=3, show="titles").observe(episode, "q", hits, None)
    assert "linked" not in unlinked.record


def test_a_plot_names_a_split_by_its_file_not_its_whole_path():
    from learners.validation import split_label

    assert split_label("phenopackets:/data/store/phenopacket-store-dev.zip#mcq_test") == \
        "phenopackets:phenopacket-store-dev.zip#mcq_test"
    assert split_label("hpo:mcq_test") == "hpo:mcq_test" and split_label("data/cases.jsonl") == "cases.jsonl"

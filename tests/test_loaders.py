"""Benchmark loaders: each reads a tiny fixture in its published layout (tests/fixtures/benchmarks) onto the Task
schema with checked, absolute image paths, and rejects malformed files and rows with a message naming file, row and
field; skip_bad=True skips and counts instead. Fixtures are copied to a temporary folder before being corrupted."""

import csv
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

from tasks import read_tasks
from tasks.loaders import (
    BenchmarkFormatError,
    hf_available,
    load_hf_saved,
    load_medxpertqa,
    load_omnimedvqa,
    load_path_vqa,
    load_pmc_vqa,
    load_slake,
    load_vqa_rad,
    main,
)

FIXTURES = Path(__file__).parent / "fixtures" / "benchmarks"
VQA_RAD = "vqa_rad/VQA_RAD Dataset Public.json"
SLAKE = "slake/Slake1.0/train.json"
PATH_VQA_JSON = "path_vqa/pvqa/qas/test/test_qa.json"
PMC_V2 = "pmc_vqa/test_2.csv"
PMC_V1 = "pmc_vqa/train.csv"
MEDX_MM = "medxpertqa/MM/test.jsonl"
MEDX_TEXT = "medxpertqa/Text/test.jsonl"
OMNI = "omnimedvqa/OmniMedVQA/QA_information/Open-access/Demo.json"


@pytest.fixture
def fx(tmp_path) -> Path:
    """A private copy of the fixture tree."""
    shutil.copytree(FIXTURES, tmp_path / "benchmarks")
    return tmp_path / "benchmarks"


def _check_images(tasks):
    for t in tasks:
        for image in t.images:
            assert os.path.isabs(image) and Path(image).is_file(), image


def _path_vqa_pickle(fx: Path, rows=None) -> Path:
    """The published PathVQA layout is a pickled list of dicts: write it from the JSON copy of its rows."""
    rows = rows if rows is not None else json.loads((fx / PATH_VQA_JSON).read_text())
    path = fx / "path_vqa/pvqa/qas/test/test_qa.pkl"
    path.write_bytes(pickle.dumps(rows))
    return path


# ---- reading the published layouts --------------------------------------------------------------------------------


def test_vqa_rad(fx):
    result = load_vqa_rad(fx / VQA_RAD)
    assert [t.id for t in result.tasks] == ["vqa_rad-1", "vqa_rad-2", "vqa_rad-3"]
    closed, counted, open_ = result.tasks
    assert closed.answer == "No" and closed.options is None and closed.metadata["answer_type"] == "closed"
    assert "yes or no" in closed.messages[0].content and closed.messages[1].content == "Is there a pneumothorax?"
    assert counted.answer == "2" and counted.metadata["answer_type"] == "open"  # a numeric answer in the file
    assert counted.metadata["split"] == "test" and open_.metadata["split"] == "train"
    assert open_.references == ["chest"] and open_.images[0].endswith("VQA_RAD Image Folder/synpic100.jpg")
    _check_images(result.tasks)
    test_only = load_vqa_rad(fx / VQA_RAD, split="test")
    assert [t.id for t in test_only.tasks] == ["vqa_rad-2"] and test_only.filtered == 2 and test_only.skipped == 0


def test_slake_with_a_language_filter(fx):
    result = load_slake(fx / SLAKE)
    assert [t.id for t in result.tasks] == ["slake-11", "slake-12", "slake-13"]
    english = load_slake(fx / SLAKE, languages=["en"])
    assert [t.id for t in english.tasks] == ["slake-11", "slake-12"] and english.filtered == 1
    assert english.tasks[0].metadata["modality"] == "X-Ray" and english.tasks[1].metadata["answer_type"] == "closed"
    _check_images(result.tasks)


def test_path_vqa_pickle_json_and_lxmert_layouts(fx):
    from_pickle = load_path_vqa(_path_vqa_pickle(fx))
    from_json = load_path_vqa(fx / PATH_VQA_JSON)
    assert [t.answer for t in from_pickle.tasks] == [t.answer for t in from_json.tasks] == ["granuloma", "yes"]
    assert from_pickle.tasks[0].images[0].endswith("pvqa/images/test/test_0001.jpg")
    assert from_pickle.tasks[1].metadata["answer_type"] == "closed"
    lxmert = [{"img_id": "test_0001", "sent": "What is present?", "label": {"granuloma": 1.0}, "question_id": 7}]
    path = fx / "path_vqa/pvqa/qas/test/test_vqa.pkl"
    path.write_bytes(pickle.dumps(lxmert))
    (task,) = load_path_vqa(path).tasks
    assert task.id == "path_vqa-7" and task.answer == "granuloma"
    _check_images(from_pickle.tasks)


def test_path_vqa_refuses_pickles_with_code(fx):
    path = fx / "path_vqa/pvqa/qas/test/evil.pkl"
    path.write_bytes(pickle.dumps([{"image": "test_0001", "question": "q", "answer": "a", "x": os.getcwd}]))
    with pytest.raises(BenchmarkFormatError, match="evil.pkl: not a plain-data pickle.*refusing to load"):
        load_path_vqa(path)


def test_pmc_vqa_v1_and_v2(fx):
    v2 = load_pmc_vqa(fx / PMC_V2)
    assert [t.id for t in v2.tasks] == ["pmc_vqa-0", "pmc_vqa-1"]
    assert v2.tasks[0].options == {"A": "CT", "B": "MRI", "C": "PET", "D": "Ultrasound"} and v2.tasks[0].answer == "A"
    assert v2.tasks[1].answer == "B" and "B. Right" in v2.tasks[1].messages[1].content
    (v1,) = load_pmc_vqa(fx / PMC_V1).tasks
    assert v1.answer == "A" and v1.options["A"] == "Nodule" and v1.references == ["Nodule"]
    _check_images(v2.tasks + [v1])


def test_medxpertqa_mm_and_text(fx):
    mm = load_medxpertqa(fx / MEDX_MM)
    assert [t.id for t in mm.tasks] == ["medxpertqa-MM-0", "medxpertqa-MM-1"]
    first, second = mm.tasks
    assert first.answer == "B" and first.options["B"] == "Bone cyst" and len(first.options) == 5
    assert first.messages[1].content.count("(A)") == 1 and "\nA. " not in first.messages[1].content
    assert [Path(p).name for p in second.images] == ["MM-1-a.jpeg", "MM-0-a.jpeg"]
    assert first.metadata["medical_task"] == "Diagnosis"
    (text,) = load_medxpertqa(fx / MEDX_TEXT).tasks
    assert text.images == [] and text.answer == "C"
    _check_images(mm.tasks)


def test_omnimedvqa_file_and_folder(fx):
    result = load_omnimedvqa(fx / OMNI)
    first, second = result.tasks
    assert first.id == "omnimedvqa-Demo_0001" and first.answer == "B" and len(first.options) == 4
    assert second.options == {"A": "CT", "B": "Fundus photography"} and second.answer == "B"  # "Fundus photography."
    assert second.metadata["modality_type"] == "Fundus Photography"  # spelt "modality" in that row
    folder = load_omnimedvqa(fx / "omnimedvqa/OmniMedVQA/QA_information")
    assert [t.id for t in folder.tasks] == [t.id for t in result.tasks]
    _check_images(result.tasks)


def test_command_line_writes_a_task_file(fx, tmp_path, capsys):
    out = tmp_path / "vqa_rad.jsonl"
    main(["vqa_rad", str(fx / VQA_RAD), "--out", str(out), "--split", "train"])
    assert [t.id for t in read_tasks(out)] == ["vqa_rad-1", "vqa_rad-3"]
    assert "1 left out by the requested filter" in capsys.readouterr().out


# ---- malformed files and rows -------------------------------------------------------------------------------------


def _edit_json(path: Path, edit) -> None:
    rows = json.loads(path.read_text(encoding="utf-8"))
    edit(rows)
    path.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")


def _edit_jsonl(path: Path, edit) -> None:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    edit(rows)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def _edit_csv(path: Path, edit) -> None:
    with open(path, newline="", encoding="utf-8") as fh:
        rows = list(csv.reader(fh))
    edit(rows)
    with open(path, "w", newline="", encoding="utf-8") as fh:
        csv.writer(fh).writerows(rows)


def _del(key, i=1):
    return lambda rows: rows[i].pop(key)


def _set(key, value, i=1):
    return lambda rows: rows[i].__setitem__(key, value)


BAD_ROWS = [
    # loader, file, editor, edit, where, field, message
    (load_vqa_rad, VQA_RAD, _edit_json, _del("question"), "item 1", "question", "missing"),
    (load_vqa_rad, VQA_RAD, _edit_json, _set("answer", ["a"]), "item 1", "answer", "expected a string"),
    (load_vqa_rad, VQA_RAD, _edit_json, _set("answer_type", "MAYBE"), "item 1", "answer_type", "OPEN or CLOSED"),
    (load_vqa_rad, VQA_RAD, _edit_json, _set("image_name", "nope.jpg"), "item 1", "image_name", "image not found"),
    (load_vqa_rad, VQA_RAD, _edit_json, _set("qid", 1, i=2), "item 2", "qid", "duplicate id 'vqa_rad-1'"),
    (load_slake, SLAKE, _edit_json, _set("img_name", "xmlab9/source.jpg", i=0), "item 0", "img_name", "not found"),
    (load_slake, SLAKE, _edit_json, _set("question", "  "), "item 1", "question", "empty"),
    (load_path_vqa, PATH_VQA_JSON, _edit_json, _del("answer"), "item 1", "answer", "missing"),
    (load_path_vqa, PATH_VQA_JSON, _edit_json, _set("image", "test_0404"), "item 1", "image", "image not found"),
    (load_pmc_vqa, PMC_V2, _edit_csv, lambda rows: rows[2].__setitem__(8, "E"), "line 3", "Answer",
     "neither an option"),
    (load_pmc_vqa, PMC_V2, _edit_csv, lambda rows: rows[1].__setitem__(1, "gone.jpg"), "line 2", "Figure_path",
     "image not found"),
    (load_pmc_vqa, PMC_V2, _edit_csv, lambda rows: rows[1].__setitem__(5, "C:MRI"), "line 2", "Choice B",
     "label of option C"),
    (load_medxpertqa, MEDX_MM, _edit_jsonl, _set("label", "F"), "line 2", "label", "not one of the option letters"),
    (load_medxpertqa, MEDX_MM, _edit_jsonl, _set("images", ["MM-9-a.jpeg"], i=0), "line 1", "images", "not found"),
    (load_medxpertqa, MEDX_MM, _edit_jsonl, _set("options", {"A": "x", "C": "y"}), "line 2", "options",
     "not consecutive"),
    (load_omnimedvqa, OMNI, _edit_json, _set("gt_answer", "Astigmatism", i=0), "item 0", "gt_answer",
     "matches no option"),
    (load_omnimedvqa, OMNI, _edit_json, _del("option_A"), "item 1", "option_B", "present although option_A"),
    (load_omnimedvqa, OMNI, _edit_json, _set("image_path", "Images/Demo/none.png"), "item 1", "image_path",
     "image not found"),
]


@pytest.mark.parametrize(("loader", "rel", "editor", "edit", "where", "field", "message"), BAD_ROWS,
                         ids=[f"{b[0].__name__}-{b[5]}-{i}" for i, b in enumerate(BAD_ROWS)])
def test_malformed_rows_name_file_row_and_field(fx, loader, rel, editor, edit, where, field, message):
    path = fx / rel
    editor(path, edit)
    with pytest.raises(BenchmarkFormatError) as err:
        loader(path)
    text = str(err.value)
    assert text.startswith(f"{path}, {where}: field '{field}': "), text
    assert message in text, text


@pytest.mark.parametrize(("loader", "rel"), [(load_vqa_rad, VQA_RAD), (load_path_vqa, PATH_VQA_JSON)])
def test_skip_bad_skips_and_reports(fx, loader, rel):
    path = fx / rel
    _edit_json(path, _del("question" if loader is load_vqa_rad else "answer", i=0))
    result = loader(path, skip_bad=True)
    assert result.skipped == 1 and len(result.tasks) == result.rows - 1
    assert result.errors[0].startswith(f"{path}, item 0: field ") and "1 malformed rows skipped" in result.summary()
    with pytest.raises(BenchmarkFormatError, match="item 0"):
        loader(path)  # without skip_bad the same file is an error


def test_path_vqa_pickle_row_errors_name_the_row(fx):
    rows = json.loads((fx / PATH_VQA_JSON).read_text())
    rows[1]["question"] = 42
    path = _path_vqa_pickle(fx, rows)
    with pytest.raises(BenchmarkFormatError) as err:
        load_path_vqa(path)
    assert str(err.value).startswith(f"{path}, row 1: field 'question': expected a string, got int")


def test_malformed_files(fx):
    vqa = fx / VQA_RAD
    vqa.write_text(json.dumps({"qid": 1}))
    with pytest.raises(BenchmarkFormatError, match=r"VQA_RAD Dataset Public.json: expected a JSON array of objects"):
        load_vqa_rad(vqa, skip_bad=True)  # a file in the wrong layout is never skipped
    vqa.write_text("[{")
    with pytest.raises(BenchmarkFormatError, match="invalid JSON"):
        load_vqa_rad(vqa)
    pmc = fx / PMC_V2
    _edit_csv(pmc, lambda rows: [r.pop(7) for r in rows])  # drop "Choice D"
    with pytest.raises(BenchmarkFormatError, match=r"test_2.csv: header: field 'Choice D': column missing"):
        load_pmc_vqa(pmc)
    medx = fx / MEDX_MM
    medx.write_text(medx.read_text().replace('"id": "MM-1"', '"id": "MM-1",,'))
    with pytest.raises(BenchmarkFormatError, match=r"test.jsonl, line 2: invalid JSON"):
        load_medxpertqa(medx)
    path = _path_vqa_pickle(fx, rows={"image": "test_0001"})
    with pytest.raises(BenchmarkFormatError, match="expected a pickled list of dicts"):
        load_path_vqa(path)
    with pytest.raises(FileNotFoundError):
        load_slake(fx / "slake/Slake1.0/test.json")


def test_verify_images_rejects_a_file_that_is_not_an_image(fx):
    (fx / "slake/Slake1.0/imgs/xmlab1/source.jpg").write_bytes(b"not an image")
    assert len(load_slake(fx / SLAKE).tasks) == 3  # existence only by default
    with pytest.raises(BenchmarkFormatError, match=r"item 0: field 'img_name': not a readable image"):
        load_slake(fx / SLAKE, verify_images=True)


# ---- Hugging Face datasets folders --------------------------------------------------------------------------------


@pytest.mark.skipif(not hf_available(), reason="the datasets package is not installed")
def test_hf_saved_folder_with_embedded_images(fx, tmp_path):
    import datasets

    png = (fx / "omnimedvqa/OmniMedVQA/Images/Demo/img_001.png").read_bytes()
    features = datasets.Features({"image": datasets.Image(), "question": datasets.Value("string"),
                                  "answer": datasets.Value("string")})
    rows = {"image": [{"bytes": png, "path": None}] * 2, "question": ["Is this normal?", "What is shown?"],
            "answer": ["yes", "fundus"]}
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows, features=features),
                                   "test": datasets.Dataset.from_dict(rows, features=features)})
    splits.save_to_disk(str(tmp_path / "vqa_rad_hf"))
    with pytest.raises(ValueError, match="name a split"):
        load_hf_saved(tmp_path / "vqa_rad_hf", "vqa_rad")
    result = load_hf_saved(tmp_path / "vqa_rad_hf", "vqa_rad", split="test", image_dir=tmp_path / "imgs")
    assert [t.answer for t in result.tasks] == ["yes", "fundus"]
    assert result.tasks[0].metadata["answer_type"] == "closed"
    written = Path(result.tasks[0].images[0])
    assert written.parent == tmp_path / "imgs" and written.suffix == ".png" and written.read_bytes() == png
    assert result.tasks[1].images == result.tasks[0].images  # the same bytes are written once

    bad = {**rows, "answer": ["yes", ""]}
    datasets.Dataset.from_dict(bad, features=features).save_to_disk(str(tmp_path / "bad_hf"))
    with pytest.raises(BenchmarkFormatError, match=r"bad_hf, row 1: field 'answer': empty"):
        load_hf_saved(tmp_path / "bad_hf", "path_vqa", image_dir=tmp_path / "imgs")


@pytest.mark.skipif(not hf_available(), reason="the datasets package is not installed")
def test_hf_saved_folder_in_a_published_layout(fx, tmp_path):
    import datasets

    rows = json.loads((fx / OMNI).read_text())
    for r in rows:
        r.setdefault("option_C", None), r.setdefault("option_D", None), r.setdefault("modality_type", None)
        r.pop("modality", None)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "omni_hf"))
    result = load_hf_saved(tmp_path / "omni_hf", "omnimedvqa", image_root=fx / "omnimedvqa/OmniMedVQA")
    assert [t.answer for t in result.tasks] == ["B", "B"] and len(result.tasks[1].options) == 2
    _check_images(result.tasks)

"""The imaging world: deterministic builds, gold boxes equal to the drawn lesions, small lesions that need a zoom-in,
findings and conditions covered by the HPO knowledge base, a disease-level train/test split, and the CDIR corpus.

One small world is built per session (about 50 images, a few seconds); the determinism test builds a second one
through the command line with two worker processes.
"""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tasks import read_tasks
from tasks.build_imaging import FILES, _is_current, ensure_imaging_world
from tasks.schema import resolve_image_paths
from tasks.imaging import (
    FINDINGS,
    FINDINGS_BY_KEY,
    IMAGE_SIZE,
    INPUT_SIZE,
    MODALITIES,
    CaseSpec,
    LesionSpec,
    cell_edges,
    mask_box,
    render_case,
)

SIZES = {"n_train": 30, "n_test": 14, "n_corpus": 10}
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def world(tmp_path_factory) -> dict[str, Path]:
    return ensure_imaging_world(tmp_path_factory.mktemp("imaging_world"), seed=0, workers=1, **SIZES)


@pytest.fixture(scope="session")
def tasks(world) -> dict:
    return {key: read_tasks(world[key]) for key in FILES if key != "cdir_corpus"}


@pytest.fixture(scope="session")
def corpus(world) -> list[dict]:
    return [json.loads(line) for line in world["cdir_corpus"].read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="session")
def kb_doc_ids() -> set[str]:
    from tasks.build_hpo import ensure_hpo_world
    from cluster.files import cache_dir

    kb = ensure_hpo_world(cache_dir() / "hpo_world", seed=0)["kb"]
    with open(kb, encoding="utf-8") as fh:
        return {json.loads(line)["doc_id"] for line in fh}


def _manifest(paths) -> dict:
    return json.loads(paths["manifest"].read_text(encoding="utf-8"))


def _cases(tasks) -> dict:
    """case_id -> metadata of the finding question (one per image)."""
    return {t.metadata["case_id"]: t.metadata for key in ("finding_mcq_train", "finding_mcq_test") for t in tasks[key]}


def test_same_seed_same_checksums_in_parallel_and_no_needless_rebuild(world, tmp_path):
    """A second build through the command line, with 2 worker processes and another hash seed, is byte-identical."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SIZES.items()]
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    cmd = [sys.executable, "-m", "tasks.build_imaging", "--out", str(tmp_path), "--seed", "0", "--workers", "2", *flags]
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, capture_output=True)
    again = ensure_imaging_world(tmp_path, seed=0, **SIZES)
    assert _manifest(again)["sha256"] == _manifest(world)["sha256"]
    assert _manifest(again)["image_sha256"] == _manifest(world)["image_sha256"]
    assert again["manifest"].read_bytes() == world["manifest"].read_bytes()
    built_at = again["manifest"].stat().st_mtime_ns
    assert ensure_imaging_world(tmp_path, seed=0, **SIZES) == again
    assert again["manifest"].stat().st_mtime_ns == built_at, "a current world must not be rebuilt"
    assert not _is_current(tmp_path, seed=1, args=_manifest(again)["args"])
    image = tmp_path / next(iter(_manifest(again)["image_sha256"]))
    image.write_bytes(image.read_bytes() + b"\0")
    assert not _is_current(tmp_path, seed=0, args=_manifest(again)["args"]), "a changed image must trigger a rebuild"


def test_another_seed_gives_other_images(world, tmp_path):
    other = ensure_imaging_world(tmp_path, seed=1, workers=1, n_train=4, n_test=2, n_corpus=1)
    ours = _manifest(world)["image_sha256"]
    theirs = _manifest(other)["image_sha256"]
    assert all(theirs[rel] != ours[rel] for rel in theirs)


def test_manifest_counts_and_checksums(world, tasks, corpus):
    manifest = _manifest(world)
    assert manifest["counts"]["images"] == {"train": 30, "test": 14, "corpus": 10}
    assert set(manifest["sha256"]) == set(FILES)
    assert len(manifest["image_sha256"]) == 54
    for split, n in (("train", 30), ("test", 14)):
        assert len(tasks[f"finding_mcq_{split}"]) == len(tasks[f"finding_open_{split}"]) == n
        assert manifest["counts"][f"condition_mcq_{split}"] == len(tasks[f"condition_mcq_{split}"])
        # only findings without a linked disease of the split lack a condition question
        no_disease = {k for k, f in manifest["findings"].items() if f["linked_diseases"][split] == 0}
        missing = Counter(t.metadata["finding"] for t in tasks[f"finding_mcq_{split}"]) - Counter(
            t.metadata["finding"] for t in tasks[f"condition_mcq_{split}"])
        assert set(missing) <= no_disease
    assert len(corpus) == 10
    for f in FINDINGS:
        assert manifest["findings"][f.key]["hpo_name"] == f.hpo_name
        assert manifest["findings"][f.key]["hpo_id"].startswith("HP:")


def test_unknown_size_argument_is_rejected(tmp_path):
    with pytest.raises(TypeError, match="n_trian"):
        ensure_imaging_world(tmp_path, n_trian=5)


def test_gold_boxes_equal_the_drawn_lesions(world, tasks):
    """Re-rendering each case from its spec gives the saved PNG; every lesion's box is the bounding box of exactly the
    pixels it changed, the pixels that differ from the lesion-free background are exactly the lesions' masks, and
    the task's gold box is the target lesion's box."""
    base = world["manifest"].parent
    for key in ("finding_mcq_train", "finding_mcq_test"):
        for task in tasks[key]:
            meta = task.metadata
            rendered = render_case(CaseSpec.from_json(meta["case"]))
            saved = np.asarray(Image.open(base / task.images[0]))
            assert np.array_equal(saved, rendered.image), task.id
            changed = rendered.image != rendered.background
            changed = changed.any(axis=2) if changed.ndim == 3 else changed
            union = np.zeros_like(changed)
            for lesion, described in zip(rendered.lesions, meta["lesions"], strict=True):
                assert mask_box(lesion.mask) == lesion.box == described["box"], task.id
                assert not (union & lesion.mask).any(), f"{task.id}: lesions overlap"
                union |= lesion.mask
                x0, y0, x1, y1 = lesion.box
                inside = np.zeros_like(changed)
                inside[y0:y1, x0:x1] = True
                assert not (lesion.mask & ~inside).any()
            assert np.array_equal(changed, union), f"{task.id}: pixels changed outside the lesion masks"
            assert task.gold_boxes == [[float(v) for v in meta["lesions"][0]["box"]]]
            assert meta["lesions"][0]["finding"] == meta["finding"]


def test_lesions_lie_in_their_named_region_and_anatomy(tasks):
    edges = cell_edges(IMAGE_SIZE)
    for meta in _cases(tasks).values():
        cells = [tuple(les["cell"]) for les in meta["lesions"]]
        assert len(set(cells)) == len(cells), "two lesions share a region"
        for les in meta["lesions"]:
            row, col = les["cell"]
            x0, y0, x1, y1 = les["box"]
            assert edges[col] <= x0 < x1 <= edges[col + 1] and edges[row] <= y0 < y1 <= edges[row + 1]
            assert tuple(les["cell"]) in MODALITIES[meta["modality"]].cells
            assert FINDINGS_BY_KEY[les["finding"]].modality == meta["modality"]
        assert meta["region"] == meta["lesions"][0]["region"]


def test_small_lesions_are_small_at_the_model_input_and_large_ones_are_not(tasks):
    scale = INPUT_SIZE / IMAGE_SIZE
    strata = Counter()
    for meta in _cases(tasks).values():
        for les in meta["lesions"]:
            x0, y0, x1, y1 = les["box"]
            side = max(x1 - x0, y1 - y0) * scale
            strata[les["stratum"]] += 1
            if les["stratum"] == "small":
                assert side <= 2.25, les  # two pixels at 84 px: needs a zoom-in
            else:
                assert side >= 5.25, les
        assert meta["needs_zoom"] == (meta["size_stratum"] == "small")
    assert strata["small"] >= 10 and strata["large"] >= 10


def test_rendering_is_a_pure_function_of_the_spec():
    spec = CaseSpec(7, "train", 3, "pathology", (LesionSpec("carcinoma", "small"), LesionSpec("granuloma", "large")))
    a, b = render_case(spec), render_case(spec)
    assert np.array_equal(a.image, b.image) and [x.box for x in a.lesions] == [x.box for x in b.lesions]
    assert a.image.shape == (IMAGE_SIZE, IMAGE_SIZE, 3) and a.image.dtype == np.uint8
    with pytest.raises(ValueError, match="does not fit"):
        render_case(CaseSpec(7, "train", 3, "chest_xray", (LesionSpec("carcinoma", "small"),)))


def test_every_finding_and_condition_has_a_knowledge_base_document(world, tasks, corpus, kb_doc_ids):
    manifest = _manifest(world)
    for f in FINDINGS:
        assert f"term:{manifest['findings'][f.key]['hpo_id']}" in kb_doc_ids, f.key
    for key, items in tasks.items():
        for t in items:
            assert t.metadata["kb_doc_id"] in kb_doc_ids
            for doc in t.metadata.get("kb_doc_ids", []):
                assert doc in kb_doc_ids, (t.id, doc)
    for row in corpus:
        assert set(row["kb_doc_ids"]) <= kb_doc_ids


def test_conditions_are_annotated_with_the_finding_and_split_by_disease(tasks):
    from tasks.hpo import load_hpo_snapshot

    snapshot = load_hpo_snapshot()

    def linked(disease_id: str, term_id: str) -> bool:
        d = snapshot.diseases[disease_id]
        return any(q != 0 and (h == term_id or term_id in snapshot.ancestors(h)) for h, q in d.phenotypes.items())

    def used(key: str) -> set[str]:
        return {d for t in tasks[key] for d in [t.metadata["disease_id"], *t.metadata["distractor_ids"]]}

    test_diseases, train_diseases = used("condition_mcq_test"), used("condition_mcq_train")
    assert test_diseases and train_diseases and not test_diseases & train_diseases
    for t in tasks["condition_mcq_train"] + tasks["condition_mcq_test"]:
        meta = t.metadata
        assert linked(meta["disease_id"], meta["hpo_id"]), t.id
        for d in meta["distractor_ids"]:
            assert not linked(d, meta["hpo_id"]), f"{t.id}: distractor {d} also has the finding"
        assert t.options[t.answer] == snapshot.diseases[meta["disease_id"]].name in t.references
        assert len(set(t.options.values())) == 4


def test_questions_name_the_region_and_options_are_balanced(world, tasks):
    base = world["manifest"].parent
    for key in ("finding_mcq_train", "finding_mcq_test", "condition_mcq_train"):
        letters = Counter(t.answer for t in tasks[key])
        assert max(letters.values()) - min(letters.values()) <= 1, (key, letters)
    for key, items in tasks.items():
        for t in items:
            assert f"the {t.metadata['region']} of the image" in t.messages[-1].content
            assert t.messages[0].role == "system" and "<answer>" in t.messages[0].content
            assert not Path(t.images[0]).is_absolute() and (base / t.images[0]).is_file()
    for t in tasks["finding_mcq_train"] + tasks["finding_mcq_test"]:
        assert t.options[t.answer] == t.metadata["hpo_name"]
        assert len(set(t.options.values())) == 4
        others = {les["hpo_id"] for les in t.metadata["lesions"][1:]}
        assert others <= set(t.metadata["distractor_hpo_ids"]), "the image's other findings must be distractors"
    for t in tasks["finding_open_test"]:
        assert t.options is None and t.answer == t.metadata["hpo_name"] == t.references[0]


def test_cdir_corpus_captions_name_finding_and_location(world, corpus):
    base = world["manifest"].parent
    for row in corpus:
        assert (base / row["image"]).is_file()
        (finding,) = row["findings"]
        assert finding["hpo_name"].lower() in row["caption"].lower()
        assert finding["hpo_id"] in row["caption"] and f"the {finding['region']} of the image" in row["caption"]


def test_resolve_image_paths(world, tasks):
    task = tasks["finding_open_test"][0]
    resolved = resolve_image_paths(task, world["manifest"].parent)
    assert Path(resolved.images[0]).is_absolute() and Path(resolved.images[0]).is_file()
    assert resolved.id == task.id

"""Hostile input that the other test modules leave out: every bad config, dataset, image, knowledge base, index,
request body or checkpoint gets a clear error naming the input (file, line or task, field), never a traceback from
deep inside a library, and whatever was already written is left byte for byte as it was.

Covered elsewhere, so not repeated here: unknown config keys, wrong types, GPU over-subscription (test_config.py);
bad JSONL lines, missing fields and non-UTF-8 task files (test_hpo_world.py); malformed benchmark rows and files
(test_loaders.py); indexes built with another encoder or corpus (test_retriever.py); Serve's image and request limits
(test_serve.py).
"""
import base64
import io
import json
import logging
import pickle
import shutil
import struct
import zlib
from pathlib import Path

import pytest

from cluster.files import sha256_file

FIXTURES = Path(__file__).parent / "fixtures" / "benchmarks"
SLAKE = "slake/Slake1.0/train.json"
SLAKE_IMAGE = "slake/Slake1.0/imgs/xmlab1/source.jpg"
QUICKSTART = "configs/tiny.yaml"

GOOD_TASK = {"id": "t1", "messages": [{"role": "user", "content": "q"}], "answer": "A", "options": {"A": "x"},
             "images": [], "gold_boxes": [], "references": [], "metadata": {}}


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under `root`: equal before and after means nothing there was touched."""
    return {str(p.relative_to(root)): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


def png_bytes(mode: str = "RGB", size=(8, 8), fmt: str = "PNG") -> bytes:
    from PIL import Image
    buffer = io.BytesIO()
    Image.new(mode, size).save(buffer, format=fmt)
    return buffer.getvalue()


def noise_png(size: int = 64) -> bytes:
    """An RGB PNG of random pixels (incompressible, so cutting its end really removes pixel data)."""
    import numpy as np
    from PIL import Image
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A valid PNG signature and header that claims `width` x `height` pixels, with no pixel data: what a
    decompression bomb looks like before anything is decoded."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


# ---- configs --------------------------------------------------------------------------------------------------------

def test_config_that_is_not_utf8_or_not_a_mapping_names_the_file(tmp_path):
    from learners.config import ConfigError, load_config

    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"output_dir: caf\xe9\n")
    with pytest.raises(ConfigError, match=rf"{latin1}: cannot read config .*utf-8"):
        load_config(latin1)
    listing = tmp_path / "list.yaml"
    listing.write_text("- output_dir: out\n")
    with pytest.raises(ConfigError, match=rf"{listing}: the top level must be a mapping"):
        load_config(listing)
    with pytest.raises(ConfigError, match=r"'group_size' is not a section"):
        load_config(QUICKSTART, ["rollout.group_size.value=3"])


def test_more_cpus_than_the_cluster_has_is_refused_naming_the_roles():
    from cluster.placement import PlacementError, check_fits
    from learners.config import load_config

    cfg = load_config(QUICKSTART, ["cluster.learner.num=4", "cluster.learner.num_cpus=2"]).cluster
    with pytest.raises(PlacementError) as err:
        check_fits(cfg, {"CPU": 2.0})
    assert "needs 9.25 CPU" in str(err.value) and "cluster.learner: 4 x 2" in str(err.value)
    assert "the cluster has 2" in str(err.value)


# ---- training datasets (tasks/schema.py through learners/data.py) ----------------------------------------------------

def test_training_set_with_a_missing_image_is_refused_before_anything_starts(tmp_path):
    from learners.data import load_tasks
    from tasks.schema import TaskFormatError

    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.png").write_bytes(png_bytes())
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({**GOOD_TASK, "images": ["images/a.png"]}) + "\n"
                    + json.dumps({**GOOD_TASK, "id": "t2", "images": ["images/a.png", "images/gone.png"]}) + "\n")
    with pytest.raises(TaskFormatError) as err:
        load_tasks(str(path))
    assert str(err.value) == (f"{path}: task 't2': field 'images.1': image not found: "
                              f"{tmp_path / 'images' / 'gone.png'}")
    (tmp_path / "images" / "gone.png").write_bytes(png_bytes())
    assert [t["images"][0] for t in load_tasks(str(path))] == [str(tmp_path / "images" / "a.png")] * 2


def test_an_image_file_that_is_no_image_is_refused_naming_task_and_field(tmp_path):
    from learners.data import load_tasks
    from tasks.schema import TaskFormatError

    (tmp_path / "scan.png").write_bytes(png_bytes()[:40])  # cut inside the header
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({**GOOD_TASK, "images": ["scan.png"]}) + "\n")
    with pytest.raises(TaskFormatError) as err:
        load_tasks(str(path))
    assert str(err.value).startswith(f"{path}: task 't1': field 'images.0': {tmp_path / 'scan.png'} is not an image "
                                     "the model's processor can take (")


def test_empty_or_truncated_training_file_names_the_file(tmp_path):
    from learners.data import load_tasks
    from tasks.schema import TaskFormatError

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(TaskFormatError, match=rf"{empty}: no tasks"):
        load_tasks(str(empty))
    cut = tmp_path / "cut.jsonl"
    line = json.dumps(GOOD_TASK)
    cut.write_text(line + "\n" + line.replace('"t1"', '"t2"')[: len(line) // 2])  # a copy stopped mid-line
    with pytest.raises(TaskFormatError, match=rf"{cut}:2: invalid JSON"):
        load_tasks(str(cut))


# ---- benchmark images and files (tasks/loaders/) ---------------------------------------------------------------------

@pytest.fixture
def fx(tmp_path) -> Path:
    shutil.copytree(FIXTURES, tmp_path / "benchmarks")
    return tmp_path / "benchmarks"


@pytest.mark.parametrize(("content", "reason"), [
    (lambda data: data[: len(data) // 3], "not a readable image"),  # a download cut short
    (lambda data: png_header_only(20_000, 20_000), "DecompressionBombError"),  # 400M pixels claimed
    (lambda data: b"", "cannot identify image file"),
], ids=["truncated", "decompression-bomb", "empty"])
def test_verify_images_names_the_row_and_field_of_a_damaged_image(fx, content, reason):
    from tasks.loaders import BenchmarkFormatError, load_slake

    image = fx / SLAKE_IMAGE
    image.write_bytes(content(image.read_bytes()))
    with pytest.raises(BenchmarkFormatError) as err:
        load_slake(fx / SLAKE, verify_images=True)
    assert str(err.value).startswith(f"{fx / SLAKE}, item 0: field 'img_name': not a readable image: {image}")
    assert reason in str(err.value)


@pytest.mark.parametrize("mode", ["L", "P", "LA", "RGBA", "CMYK", "I;16", "1"])
def test_verify_images_accepts_every_ordinary_image_mode(fx, mode):
    """Grey, palette, alpha, CMYK, 16-bit and 1-bit images are images: loading must not refuse them (the model side
    converts to RGB, see test_serve_images_decode_every_mode_to_rgb)."""
    from tasks.loaders import load_slake

    (fx / SLAKE_IMAGE).write_bytes(png_bytes(mode, fmt="TIFF" if mode == "CMYK" else "PNG"))
    assert len(load_slake(fx / SLAKE, verify_images=True).tasks) == 3


def test_non_utf8_csv_and_truncated_pickle_name_the_file(fx):
    from tasks.loaders import BenchmarkFormatError, load_path_vqa, load_pmc_vqa

    csv_path = fx / "pmc_vqa/test_2.csv"
    lines = csv_path.read_bytes().split(b"\n")
    lines[2] = b"\xff" + lines[2]
    csv_path.write_bytes(b"\n".join(lines))
    with pytest.raises(BenchmarkFormatError, match=rf"{csv_path}, line 3: not valid UTF-8"):
        load_pmc_vqa(csv_path)
    rows = json.loads((fx / "path_vqa/pvqa/qas/test/test_qa.json").read_text())
    pkl = fx / "path_vqa/pvqa/qas/test/test_qa.pkl"
    pkl.write_bytes(pickle.dumps(rows)[:-20])
    with pytest.raises(BenchmarkFormatError, match=rf"{pkl}: not a plain-data pickle"):
        load_path_vqa(pkl)


def test_a_failed_conversion_leaves_the_existing_task_file_untouched(fx, tmp_path):
    from tasks.loaders import BenchmarkFormatError, main

    out = tmp_path / "slake.jsonl"
    main(["slake", str(fx / SLAKE), "--out", str(out)])
    before = sha256_file(out)
    (fx / SLAKE).write_text("[{", encoding="utf-8")
    with pytest.raises(BenchmarkFormatError, match="invalid JSON"):
        main(["slake", str(fx / SLAKE), "--out", str(out)])
    assert sha256_file(out) == before


# ---- knowledge bases and indexes ------------------------------------------------------------------------------------

CHUNK = {"id": "d#0", "doc_id": "d", "title": "Marfan syndrome", "text": "tall stature", "source": "test"}


@pytest.mark.parametrize(("line", "where", "message"), [
    (b'{"id": "x#0", "doc_id": ', ":2:", "not a UTF-8 JSON line"),
    (json.dumps({**CHUNK, "id": "x#0", "text": None}).encode(), ":2:", "field 'text': missing or not a string"),
    (json.dumps({k: v for k, v in CHUNK.items() if k != "doc_id"}).encode(), ":2:", "field 'doc_id'"),
    (b"[1, 2]", ":2:", "field 'id'"),
    (json.dumps(CHUNK).encode().replace(b"tall", b"t\xe4ll"), ":2:", "not a UTF-8 JSON line"),
], ids=["cut-line", "null-text", "missing-doc_id", "not-an-object", "latin1"])
def test_bad_knowledge_base_line_names_file_line_and_field_and_keeps_the_old_index(tmp_path, line, where, message):
    from indexing.build_index import build_index

    kb = tmp_path / "kb.jsonl"
    kb.write_bytes(json.dumps(CHUNK).encode() + b"\n" + line + b"\n")
    index = tmp_path / "index"
    index.mkdir()
    (index / "manifest.json").write_text('{"format": 1}')  # stands for an index built earlier
    before = tree_digest(index)
    with pytest.raises(ValueError) as err:
        build_index(kb, index, encoder="minilm", progress=False)
    assert str(err.value).startswith(f"{kb}{where}") and message in str(err.value)
    assert tree_digest(index) == before


def test_unreadable_index_manifest_is_named_and_ensure_index_would_rebuild(tmp_path):
    from indexing.retrieval_index import IndexMismatchError, read_manifest
    from actors.retriever import LocalRetriever

    (tmp_path / "manifest.json").write_text('{"format": 1, "encoder": ')  # a copy cut short
    with pytest.raises(IndexMismatchError, match=rf"{tmp_path / 'manifest.json'} is not a readable index manifest"):
        read_manifest(tmp_path)
    with pytest.raises(IndexMismatchError, match="rebuild the index"):
        LocalRetriever(tmp_path)


# ---- Serve request bodies and images, without a server ---------------------------------------------------------------

@pytest.mark.parametrize(("body", "message"), [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"model": "medray", "messages": [{"role": "user", "content": "\\ud800"}]}', "unpaired surrogate"),
    (b'{"model": "m\xff"}', "not valid JSON"),
    (b"", "not valid JSON"),
], ids=["deeply-nested", "lone-surrogate", "not-utf8", "empty"])
def test_request_bodies_that_would_crash_a_parser_or_tokenizer_are_400(body, message):
    from serve.protocol import APIError, decode_body

    with pytest.raises(APIError, match=message) as err:
        decode_body(body)
    assert err.value.status == 400
    assert decode_body('{"content": "caf\u00e9 \U0001F600"}'.encode()) == {"content": "caf\u00e9 \U0001F600"}


@pytest.mark.parametrize("mode", ["L", "P", "LA", "RGBA", "CMYK", "I;16", "1", "F"])
def test_serve_images_decode_every_mode_to_rgb(mode):
    from serve.config import Limits
    from serve.images import load_image

    fmt = "TIFF" if mode in ("CMYK", "F") else "PNG"
    url = "data:image/png;base64," + base64.b64encode(png_bytes(mode, fmt=fmt)).decode()
    image = load_image(url, Limits(), "p")
    assert image.mode == "RGB" and image.size == (8, 8)


@pytest.mark.parametrize(("data", "message"), [
    (lambda: noise_png()[:-400], "could not be decoded"),
    (lambda: b"", "could not be decoded"),
    (lambda: png_header_only(50_000, 50_000), "more than 16777216 pixels"),
], ids=["truncated", "empty", "header-claims-2.5G-pixels"])
def test_serve_refuses_damaged_images_with_400(data, message):
    from serve.config import Limits
    from serve.images import load_image
    from serve.protocol import APIError

    with pytest.raises(APIError, match=message) as err:
        load_image("data:image/png;base64," + base64.b64encode(data()).decode(), Limits(), "p")
    assert err.value.status == 400


# ---- checkpoints ----------------------------------------------------------------------------------------------------

def fake_checkpoint(root: Path, step: int) -> Path:
    """A checkpoint written through the real commit path: weights as safetensors, a config, the trainer state."""
    import torch
    from safetensors.torch import save_file

    from learners import checkpoint as ckpt
    tmp = ckpt.staging_dir(root, step)
    save_file({"w": torch.full((64, 64), float(step))}, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text('{"model_type": "qwen2"}')
    return ckpt.commit(root, tmp, step, {"step": step}, keep_last=3)


@pytest.mark.parametrize(("damage", "problem"), [
    (lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:1000]),
     "model.safetensors does not match its checksum"),
    (lambda p: (p / "model.safetensors").write_bytes(b"\0" * (p / "model.safetensors").stat().st_size),
     "model.safetensors does not match its checksum"),
    (lambda p: (p / "config.json").unlink(), "config.json is missing"),
    (lambda p: (p / "manifest.json").write_text("{"), "no readable manifest"),
], ids=["truncated-weights", "zeroed-weights", "missing-file", "broken-manifest"])
def test_damaged_checkpoint_falls_back_to_the_previous_good_one(tmp_path, caplog, damage, problem):
    from learners import checkpoint as ckpt

    root = tmp_path / "checkpoints"
    good, newest = fake_checkpoint(root, 1), fake_checkpoint(root, 2)
    assert ckpt.latest_valid(root) == newest
    before = tree_digest(good)
    damage(newest)
    with caplog.at_level(logging.WARNING, logger="medray.checkpoint"):
        assert ckpt.latest_valid(root) == good
    assert f"checkpoint {newest} is damaged ({problem}" in caplog.text and "trying the previous one" in caplog.text
    assert ckpt.read_state(good) == {"step": 1} and tree_digest(good) == before
    damage(good)
    assert ckpt.latest_valid(root) is None

"""A run's storage (`storage.path`): checkpoints committed by a manifest uploaded last, read back by resume and serve.

The storage here is a `file://` URI on a directory apart from output_dir: the same pyarrow.fs code path an `s3://` or
`gs://` bucket takes, with no network."""
import json
import shutil
from pathlib import Path

import pytest

from learners import checkpoint as ckpt
from cluster.storage import MANIFEST, Storage, fetch_checkpoint, newest_valid, upload_share


def write_checkpoint(root: Path, step: int, model_dir: Path | None = None) -> Path:
    """A checkpoint through the real commit path: a model directory's files (or one small file) and trainer state."""
    tmp = ckpt.staging_dir(root, step)
    if model_dir is not None:
        shutil.copytree(model_dir, tmp, dirs_exist_ok=True)
    (tmp / "weights.bin").write_bytes(bytes([step]) * 4096)
    return ckpt.commit(root, tmp, step, {"step": step}, keep_last=5)


def no_one_else(uri):
    return lambda: None


def test_published_checkpoints_are_committed_by_their_manifest_and_pruned(tmp_path):
    root, store = tmp_path / "out" / "checkpoints", Storage(f"file://{tmp_path}/store")
    for step in (1, 2, 3):
        ckpt.publish(store, write_checkpoint(root, step), no_one_else, keep_last=2)
    assert store.committed_steps("checkpoints") == [2, 3]
    assert set(store.files("checkpoints/step_3")) == {MANIFEST, "weights.bin", ckpt.STATE}
    # an upload cut short: files there, the manifest not yet
    store.upload(write_checkpoint(root, 4), ["weights.bin", ckpt.STATE], "checkpoints/step_4")
    assert store.steps("checkpoints") == [2, 3, 4] and store.committed_steps("checkpoints") == [2, 3]
    uri, local = newest_valid(store.uri("checkpoints"), tmp_path / "elsewhere")
    assert uri.endswith("/checkpoints/step_3") and ckpt.read_state(local) == {"step": 3}
    assert ckpt.verify(local) is None


def test_a_checkpoint_that_does_not_verify_after_download_is_skipped(tmp_path, caplog):
    root, store = tmp_path / "out" / "checkpoints", Storage(str(tmp_path / "store"))
    for step in (1, 2):
        ckpt.publish(store, write_checkpoint(root, step), no_one_else, keep_last=2)
    (tmp_path / "store" / "checkpoints" / "step_2" / "weights.bin").write_bytes(b"torn")
    assert (tmp_path / "store" / "checkpoints" / "latest").resolve().name == "step_2"  # a local directory's link
    uri, local = newest_valid(store.uri("checkpoints"), tmp_path / "elsewhere")
    assert uri.endswith("step_1") and ckpt.read_state(local) == {"step": 1}
    assert "weights.bin does not match its checksum" in caplog.text


def test_a_nodes_share_is_uploaded_from_it_and_removed_there(tmp_path):
    share = tmp_path / "node_b" / ".step_7.ab12.tmp"
    (share / "deepspeed").mkdir(parents=True)
    (share / "deepspeed" / "zero_pp_rank_1_optim_states.pt").write_bytes(b"rank 1")
    upload_share(share, ["deepspeed/zero_pp_rank_1_optim_states.pt"], f"file://{tmp_path}/store/checkpoints/step_7")
    assert (tmp_path / "store/checkpoints/step_7/deepspeed/zero_pp_rank_1_optim_states.pt").read_bytes() == b"rank 1"
    assert not share.exists()
    # the driver's node uploads what it holds; each file it lacks goes to the first rank of a node that has it
    held = {2: {"deepspeed/zero_pp_rank_2.pt": "c", "tokenizer.json": "t"}, 1: {"deepspeed/zero_pp_rank_1.pt": "b"}}
    assert ckpt.assign_uploads({"model.safetensors", "tokenizer.json"}, held) == \
        {1: ["deepspeed/zero_pp_rank_1.pt"], 2: ["deepspeed/zero_pp_rank_2.pt"]}


def test_serve_reads_the_newest_committed_checkpoint_from_storage(tmp_path, tiny_model_path, monkeypatch):
    from serve.config import ServeSettings
    monkeypatch.setenv("MEDRAY_CACHE", str(tmp_path / "cache"))
    root, store = tmp_path / "run" / "checkpoints", Storage(f"file://{tmp_path}/store")
    ckpt.publish(store, write_checkpoint(root, 1, tiny_model_path), no_one_else, keep_last=2)
    store.upload(write_checkpoint(root, 2, tiny_model_path), ["config.json"], "checkpoints/step_2")  # cut short
    settings = ServeSettings(checkpoint=f"file://{tmp_path}/store/checkpoints/latest").resolved()
    assert settings.checkpoint == f"file://{tmp_path}/store/checkpoints/step_1"
    local = fetch_checkpoint(settings.checkpoint)[1]
    assert local.is_relative_to(tmp_path / "cache") and json.loads((local / ckpt.STATE).read_text()) == {"step": 1}
    with pytest.raises(ValueError, match="not a committed checkpoint"):
        ServeSettings(checkpoint=f"file://{tmp_path}/store/checkpoints/step_2").resolved()


def test_a_fresh_run_is_refused_where_storage_already_holds_one(tmp_path):
    from cluster.storage import run_storage
    store = Storage(f"file://{tmp_path}/store")
    ckpt.publish(store, write_checkpoint(tmp_path / "a" / "checkpoints", 1), no_one_else, keep_last=2)
    with pytest.raises(FileExistsError, match=f"storage.path file://{tmp_path}/store already holds a run"):
        ckpt.refuse_existing_run(tmp_path / "b", run_storage(f"file://{tmp_path}/store", tmp_path / "b"))
    assert run_storage(str(tmp_path / "b"), tmp_path / "b") is None  # output_dir itself: nothing to publish
    assert run_storage(None, tmp_path / "b") is None

"""Weights & Biases in offline mode: what a later `wandb sync` uploads, read back from the run directory W&B writes
(the grouped names, each at its step; the run's name, project and config; one W&B run across a resume)."""
import json
import struct
import time
from pathlib import Path

import pytest
import yaml

from learners.config import LoggingConfig
from learners.metrics import MetricsLogger


def wandb_records(run_dir: Path) -> list:
    """The protobuf Records of an offline W&B run's transaction log (run-<id>.wandb): a 7-byte header (':W&B', magic,
    version), then LevelDB log blocks of 32 KiB whose chunks (crc32, length, type, data) join into records. Only the
    complete records of a log still being written."""
    from wandb.proto.wandb_internal_pb2 import Record

    (log,) = run_dir.glob("run-*.wandb")
    data, block = log.read_bytes(), 32768
    assert data[:4] == b":W&B"[:len(data)], f"{log} is not a W&B transaction log"
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        if pos + 7 + length > len(data):  # a chunk still being written
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a FULL chunk, or the LAST of a record's chunks
            records.append(Record.FromString(pending))
            pending = b""
    return records


def history(run_dir: Path) -> dict[int, dict]:
    """step -> {name: value} of what the run logged (W&B's own _step, _runtime, _timestamp left out)."""
    rows = {}
    for record in wandb_records(run_dir):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            rows[items.pop("_step")] = {k: v for k, v in items.items() if not k.startswith("_")}
    return rows


def run_record(run_dir: Path):
    return next(r.run for r in wandb_records(run_dir) if r.WhichOneof("record_type") == "run")


def offline_runs(out: Path, timeout_s: float = 60.0) -> list[Path]:
    """The offline run directories under `out`/wandb, oldest first, once each log ends with the run's exit record:
    wandb.finish() returns before the wandb-core service has written it all (it has by the time the process exits)."""
    runs = sorted((out / "wandb").glob("offline-run-*"))
    deadline = time.monotonic() + timeout_s
    for run_dir in runs:
        while not (records := wandb_records(run_dir)) or records[-1].WhichOneof("record_type") != "exit":
            assert time.monotonic() < deadline, f"{run_dir}: W&B did not finish writing the run"
            time.sleep(0.5)
    return runs


STEPS = [{"step": 1, "reward_mean": 0.25, "accuracy": 0.125, "reward/format": 0.5, "kl": 0.001, "train_s": 2.5,
          "weight_version": 1, "stage": 0, "stage_name": "grpo", "eval/hpo:mcq_test/accuracy": 0.3},
         {"step": 2, "reward_mean": 0.75, "accuracy": 0.375, "reward/format": 1.0, "kl": 0.002, "train_s": 2.0,
          "weight_version": 2, "stage": 0, "stage_name": "grpo"}]


def test_offline_wandb_holds_the_grouped_names_at_their_steps(tmp_path):
    out = tmp_path / "my_run"
    out.mkdir()
    (out / "config.yaml").write_text(yaml.safe_dump({"seed": 3, "rollout": {"group_size": 4}}))
    cfg = LoggingConfig(tensorboard=False, progress_bar=False, wandb={"project": "medray-test", "mode": "offline"})
    metrics = MetricsLogger(out, cfg)
    for record in STEPS:
        metrics.log(record)
    metrics.close()

    (run_dir,) = offline_runs(out)
    assert history(run_dir) == {
        1: {"reward/mean": 0.25, "reward/accuracy": 0.125, "reward/format": 0.5, "actor/kl": 0.001,
            "timing/train_s": 2.5, "weights/weight_version": 1, "progress/stage": 0, "eval/hpo:mcq_test/accuracy": 0.3},
        2: {"reward/mean": 0.75, "reward/accuracy": 0.375, "reward/format": 1.0, "actor/kl": 0.002,
            "timing/train_s": 2.0, "weights/weight_version": 2, "progress/stage": 0}}
    run = run_record(run_dir)
    assert (run.project, run.display_name) == ("medray-test", "my_run")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["seed"] == 3 and config["rollout"] == {"group_size": 4}
    # metrics.jsonl keeps the flat names
    assert [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] == STEPS


def test_a_resumed_run_continues_its_wandb_run(tmp_path):
    cfg = LoggingConfig(tensorboard=False, progress_bar=False, wandb={"mode": "offline", "name": "named"})
    first = MetricsLogger(tmp_path, cfg)
    first.log(STEPS[0])
    first.close()
    resumed = MetricsLogger(tmp_path, cfg, resume_step=1)
    resumed.log(STEPS[1])
    resumed.close()

    runs = offline_runs(tmp_path)
    assert len(runs) == 2
    assert {run_record(r).run_id for r in runs} == {(tmp_path / "wandb" / "run_id").read_text().strip()}
    assert [sorted(history(r)) for r in runs] == [[1], [2]]
    assert run_record(runs[1]).display_name == "named"

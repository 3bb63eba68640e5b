"""Where a run's numbers go: metrics.jsonl (one line per step), TensorBoard, and the progress bar."""
from __future__ import annotations

import json
import math
import re
from contextlib import contextmanager
from pathlib import Path

from learners.config import LoggingConfig

BAR_KEYS = [("sft_loss", "loss"), ("reward_mean", "reward"), ("accuracy", "acc"), ("response_length", "len"), ("kl", "kl"),
            ("generate_s", "gen_s"), ("train_s", "train_s"), ("version_lag", "lag")]


def _step(line: str) -> float:
    """A metrics line's step; a blank line or one torn by a killed driver counts as after every checkpoint."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return math.inf


class MetricsLogger:
    def __init__(self, out: Path, cfg: LoggingConfig, resume_step: int | None = None):
        self.path = out / "metrics.jsonl"
        self.cfg = cfg
        if resume_step is not None and self.path.exists():
            # Steps after the checkpoint are trained again; keep the log one line per step.
            kept = [line for line in self.path.read_text().splitlines() if _step(line) <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self.file = open(self.path, "a", buffering=1)
        self.tb = None
        self.gauges: dict = {}
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(out / "tensorboard"), purge_step=resume_step)

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        scalars = {k: v for k, v in record.items()
                   if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}
        for k, v in scalars.items():
            if self.tb:
                self.tb.add_scalar(k, v, record["step"])
            self._gauge(k).set(v)

    def _gauge(self, key: str):
        """A Ray metric per scalar (medray_reward_mean, ...), so the dashboard's metrics view shows training
        next to the actors and resources."""
        if key not in self.gauges:
            from ray.util.metrics import Gauge
            name = "medray_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
            self.gauges[key] = Gauge(name, description=f"medray training metric {key}")
        return self.gauges[key]

    @contextmanager
    def progress(self, total: int, start: int):
        from tqdm import tqdm
        bar = tqdm(total=total, initial=start, desc="train", unit="step", disable=not self.cfg.progress_bar,
                   dynamic_ncols=True)

        class Bar:
            @staticmethod
            def update(record: dict) -> None:
                bar.set_description(record.get("stage_name", "train"), refresh=False)
                bar.set_postfix({short: f"{record[k]:.3g}" for k, short in BAR_KEYS if k in record}, refresh=False)
                bar.update(1)
        try:
            yield Bar
        finally:
            bar.close()

    def close(self) -> None:
        self.file.close()
        if self.tb:
            self.tb.close()

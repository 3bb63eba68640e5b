"""Helpers the benchmark scripts share: a results table on stdout and a JSON file."""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path

from tasks.tiny_models import TinyModelConfig

# ~50M parameters: the size at which the throughput targets are set.
MODEL_50M = TinyModelConfig(hidden_size=640, intermediate_size=2048, num_hidden_layers=10, num_attention_heads=10,
                            num_key_value_heads=5)
MODEL_TINY = TinyModelConfig()


def report(name: str, rows: list[dict], out_dir: str = "benchmarks/results") -> Path:
    """Print rows as an aligned table and write them, with the machine, to <out_dir>/<name>.json."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[_fmt(r.get(k, "")) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths)))
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths)))
    path = Path(out_dir) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": name, "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                                "machine": platform.processor() or platform.machine(), "rows": rows}, indent=1))
    print(f"wrote {path}")
    return path


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)

"""Train with GRPO on Ray.

    python learners/run.py --config configs/quickstart.yaml [dotted.key=value ...]

Starts a local Ray bound to 127.0.0.1, or joins the cluster in RAY_ADDRESS (what `ray job submit` sets).
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from any directory

from learners.config import ConfigError, load_config  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML run config (see configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value, e.g. rollout.group_size=4 resume=true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from learners.trainer import Trainer
    try:
        history = Trainer(cfg).fit()
    except FileExistsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if history:
        first, last = history[0], history[-1]
        print(f"done: {len(history)} steps, reward {first['reward_mean']:.3f} -> {last['reward_mean']:.3f}; "
              f"outputs in {cfg.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

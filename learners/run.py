"""Train with GRPO on Ray.

    python learners/run.py --config configs/quickstart.yaml [dotted.key=value ...]
    python learners/run.py --config configs/med_rwr_cluster.yaml --dry-run   # resolve and place, start nothing

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
    parser.add_argument("--dry-run", action="store_true", help="print stages, placement and memory; start nothing")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="dry run: GPUs per cluster node")
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0, help="dry run: memory of one GPU")
    parser.add_argument("--node-memory-gb", type=float, default=None,
                        help="dry run of a CPU run: the machine's memory (default: this machine's)")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        from learners.dry_run import dry_run, print_plan
        try:
            plan = dry_run(cfg, args.gpus_per_node, args.gpu_memory_gb, args.node_memory_gb)
        except FileNotFoundError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print_plan(plan)
        return 2 if plan["errors"] else 0
    from learners import console
    from learners.learner_group import LearnerRankFailed
    from learners.trainer import Trainer
    run_log = console.configure(Path(cfg.output_dir), cfg.logging.verbose)
    # Ray starts (or is joined) in the run's Fleet (learners/fleet.py); then the actors' output goes to run.log
    trainer = Trainer(cfg, on_ray_start=None if cfg.logging.verbose else lambda: console.route_actor_output(run_log))
    try:
        history = trainer.fit()
    except FileExistsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except LearnerRankFailed as e:
        print("\n".join([f"error: {e}", *getattr(e, "__notes__", [])]), file=sys.stderr)  # notes: restarts left
        return 1
    if history:
        from learners.validation import gain_summary
        # reward_mean is over every group a step sampled (with dynamic sampling too: the kept ones are *_kept)
        rewards = [h["reward_mean"] for h in history if "reward_mean" in h]
        summary = f"reward {rewards[0]:.3f} -> {rewards[-1]:.3f}; " if rewards else ""
        summary += gain_summary(Path(cfg.output_dir))  # what the last stage added to held-out accuracy
        print(f"done: {len(history)} steps, {summary}outputs in {cfg.output_dir} (log: {run_log})")
    if trainer.report:
        print("\n" + trainer.report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

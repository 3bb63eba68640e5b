"""medray: one command for training, evaluation, serving and the offline builds.

    medray train --config configs/quickstart.yaml [dotted.key=value ...]
    medray dry-run --config configs/med_rwr_cluster.yaml [--gpus-per-node 8 --gpu-memory-gb 80]
    medray eval --config configs/quickstart.yaml --checkpoint outputs/quickstart/checkpoints/latest --data hpo:mcq_test
    medray serve [serve.app:app | configs/serve.yaml] [checkpoint=... key=value ...]
    medray build-index --kb hpo --out outputs/hpo_index
    medray expert --config configs/quickstart.yaml --data hpo:mcq_train --out outputs/demos.jsonl
    medray build-model smollm2-135m-instruct | smollm2-135m-vision [field=value ...]
    medray traces outputs/quickstart [--out page.html]

Each command runs a module of this repository with the arguments it is given (`medray <command> --help` lists them);
`python learners/run.py ...` (what `ray job submit` runs) and `python -m <module> ...` do the same.
"""
from __future__ import annotations

import argparse
import importlib
import sys

#: command -> (module whose main(argv) runs it, arguments put before the user's, one-line help)
COMMANDS = {
    "train": ("learners.run", [], "train a config's stages (GRPO, SFT) on Ray"),
    "dry-run": ("learners.run", ["--dry-run"], "print a config's stages, placement and memory; start nothing"),
    "eval": ("learners.evaluate", [], "score a checkpoint on a task split through rollout workers"),
    "serve": (None, [], "serve a checkpoint with Ray Serve (`serve run`; default app serve.app:app)"),
    "build-index": ("indexing.build_index", [], "build a retrieval index (BM25, FAISS) over a knowledge base"),
    "expert": ("learners.expert", [], "write the scripted expert's demonstrations for an SFT cold start"),
    "build-model": ("tasks.model_aliases", [], "build a model alias offline (smollm2-135m-instruct, "
                                               "smollm2-135m-vision)"),
    "traces": ("learners.traces", [], "write a self-contained HTML page of a run's episodes, step by step"),
}


def serve(argv: list[str]) -> int:
    """`serve run` with the app defaulting to serve.app:app, so `medray serve checkpoint=...` is enough."""
    from ray.serve.scripts import cli
    if not argv or "=" in argv[0] or argv[0].startswith("-"):
        argv = ["serve.app:app", *argv]
    return cli.main(args=["run", *argv], prog_name="medray serve", standalone_mode=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="medray", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name, (_, _, text) in COMMANDS.items():
        commands.add_parser(name, help=text, add_help=False)  # --help goes to the command's own parser
    args, rest = parser.parse_known_args(argv)
    module, prefix, _ = COMMANDS[args.command]
    if module is None:
        return serve(rest)
    sys.argv[0] = f"medray {args.command}"  # the usage line of the module's own parser
    return importlib.import_module(module).main([*prefix, *rest]) or 0


if __name__ == "__main__":
    sys.exit(main())

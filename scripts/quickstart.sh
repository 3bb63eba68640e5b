#!/usr/bin/env bash
# Set up (idempotent) and run the main job: a tiny end-to-end GRPO training on a local Ray.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python learners/run.py --config configs/quickstart.yaml "$@"

#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite, the slow end-to-end runs included; the 25 slowest tests are listed
# at the end, so the suite's time stays visible where it grows.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q --durations=25 "$@"

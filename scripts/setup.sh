#!/usr/bin/env bash
# Create .venv (idempotent) with the CPU build of torch and kvengine installed editable.
# Usage: scripts/setup.sh [extras]   e.g. scripts/setup.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
py=.venv/bin/python
$py -m pip install -q --upgrade pip >/dev/null
# An unpinned torch pulls a multi-GB CUDA build: install the CPU build first.
if ! $py -c "import torch" 2>/dev/null; then
  wheel=$(ls /opt/wheels/torch-2.13.0+cpu-*.whl 2>/dev/null | head -n1 || true)
  if [ -n "$wheel" ]; then
    $py -m pip install -q "$wheel"
  else
    $py -m pip install -q "torch==2.13.0"
  fi
fi
if [ -n "$extras" ]; then
  $py -m pip install -q -e ".[$extras]"
else
  $py -m pip install -q -e .
fi

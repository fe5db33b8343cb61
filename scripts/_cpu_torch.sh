# Sourced by the set-up scripts. install_cpu_torch PYTHON: install the CPU build of torch
# 2.13.0 into that interpreter's venv unless a CPU build is there already. An unpinned
# torch (or one pulled in by another package) would be a multi-GB CUDA build.
install_cpu_torch() {
  local py=$1 wheel
  if "$py" -c "import torch, sys; sys.exit('+cpu' not in torch.__version__)" 2>/dev/null; then
    return 0
  fi
  wheel=$(ls /opt/wheels/torch-2.13.0+cpu-*.whl 2>/dev/null | head -n1 || true)
  "$py" -m pip install -q "${wheel:-torch==2.13.0}"
}

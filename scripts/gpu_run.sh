#!/usr/bin/env bash
# The GPU run, on the GPU machine (no package registry, no vLLM): install the carried wheels
# (scripts/gpu_bundle.sh) next to the source tree where pydantic is missing, then benchmarks/bench_gpu.py -- the engine with KV on the
# device against torch's raw copies, kvengine verify hf's proof on three families with model and cache on
# the device, the vLLM device self-check on hand-built GPU backend layouts. Arguments go to bench_gpu.py.
# Results: $OUT/gpu.json (or benchmarks/results/gpu.json without $OUT).
#   device tool:  run(command="bash scripts/gpu_run.sh", carry=[".gpu"], timeout_s=480)
#   smoke here:   PYTHON=.venv/bin/python bash scripts/gpu_run.sh --device cpu --tokens 2048 --layers 4
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
site=$(mktemp -d)
if ! $py -c "import pydantic" 2>/dev/null && compgen -G ".gpu/wheels/*.whl" >/dev/null; then
  $py -m pip install -q --no-index --no-deps --target "$site" .gpu/wheels/*.whl
fi
out="${OUT:+$OUT/gpu.json}"
nvidia-smi -L 2>/dev/null || true
PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" $py benchmarks/bench_gpu.py --skip-vllm \
  --out "${out:-gpu.json}" "$@"

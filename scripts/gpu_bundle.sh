#!/usr/bin/env bash
# Prepare the GPU run (scripts/gpu_run.sh) here: the wheels kvengine needs that the GPU machine lacks
# (docs: ../shared/notes/gpu-and-versions.md: Python 3.12, torch, transformers; no pydantic, no registry),
# downloaded for its Python into .gpu/wheels (ignored by git; the device tool carries it: carry [".gpu"]).
# pydantic and pydantic-core are pinned to the versions .venv runs (pydantic pins its core exactly).
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
pyver="${GPU_PYTHON_VERSION:-3.12}"
pydantic=$($py -c "import pydantic; print(pydantic.VERSION)")
core=$($py -c "import pydantic_core; print(pydantic_core.__version__)")
rm -rf .gpu/wheels
mkdir -p .gpu/wheels
$py -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu/wheels "pydantic==$pydantic" "pydantic-core==$core" annotated-types typing-inspection typing-extensions
du -sh .gpu/wheels

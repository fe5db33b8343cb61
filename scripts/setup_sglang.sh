#!/usr/bin/env bash
# Create .venv-sglang (idempotent): CPU torch, SGLang 0.5.23 without its
# dependency tree, the modules its imports need, and kvengine[test] editable.
#
# SGLang's declared requirements replace CPU torch with a CUDA build and pull
# flashinfer / sglang-kernel, so SGLang is installed with --no-deps and every
# later install runs under a constraint that pins the installed torch.
# Usage: bash scripts/setup_sglang.sh      (re-running is cheap once set up)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-sglang
py=$venv/bin/python
stamp=$venv/.kvengine-setup-$(sha256sum "$0" pyproject.toml | sha256sum | cut -c1-16)

check() {
  $py - <<'EOF'
import torch, sglang.srt.mem_cache.hicache_storage, kvengine
assert "+cpu" in torch.__version__, f"torch {torch.__version__} is not the CPU build"
EOF
}

if [ -f "$stamp" ] && check 2>/dev/null; then
  echo "setup_sglang: $venv is up to date"
  exit 0
fi

if [ ! -x "$py" ]; then
  python3 -m venv "$venv"
fi
$py -m pip install -q --upgrade pip >/dev/null

# 1. CPU torch (never the CUDA build).
source scripts/_cpu_torch.sh
install_cpu_torch "$py"
torch_version=$($py -c "import torch; print(torch.__version__)")
constraints=$venv/constraints.txt
echo "torch==${torch_version}" >"$constraints"

# 2. SGLang itself, without letting pip resolve its requirements.
$py -m pip install -q --no-deps "sglang==0.5.23"

# 3. What SGLang's imports need for the storage API, host pools and HiCacheController on CPU.
#    transformers is bounded like kvengine's [test] extra so step 4 does not move it.
$py -m pip install -q -c "$constraints" \
  numpy psutil pydantic msgspec orjson pyzmq requests packaging xxhash setproctitle pybase64 \
  triton pillow starlette tqdm IPython aiohttp "transformers>=5.16.1,<5.20" dill apache-tvm-ffi \
  sentencepiece compressed-tensors gguf

# 4. kvengine with its test extras, editable; torch stays the CPU build.
$py -m pip install -q -c "$constraints" -e ".[test]"

check
rm -f $venv/.kvengine-setup-*
touch "$stamp"
echo "setup_sglang: $venv ready (torch $torch_version, sglang $($py -c 'import importlib.metadata as m; print(m.version("sglang"))'))"

#!/usr/bin/env bash
# Create .venv-lmcache (idempotent): CPU torch and LMCache 0.5.6 for the
# side-by-side benchmark (benchmarks/bench_vs_lmcache.py).
#
# LMCache's declared requirements include CUDA-only packages (cupy, cuda-python,
# cufile) and GCP/gRPC extras it does not need on CPU, and an unpinned torch
# would be replaced by a CUDA build. So LMCache is installed with --no-deps and
# its requirements are installed from its own metadata minus those, under a
# constraint that pins the installed CPU torch (see shared/notes/lmcache.md).
# kvengine itself is NOT installed here: the two systems never share a process.
# Usage: bash scripts/setup_lmcache.sh      (re-running is cheap once set up)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-lmcache
py=$venv/bin/python
lmcache_version=0.5.6
stamp=$venv/.kvengine-setup-$(sha256sum "$0" | sha256sum | cut -c1-16)

check() {
  $py - <<'EOF'
import torch
assert "+cpu" in torch.__version__, f"torch {torch.__version__} is not the CPU build"
from lmcache.v1.cache_engine import LMCacheEngineBuilder  # noqa: F401
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface  # noqa: F401
EOF
}

if [ -f "$stamp" ] && check >/dev/null 2>&1; then
  echo "setup_lmcache: $venv is up to date"
  exit 0
fi

if [ ! -x "$py" ]; then
  python3.11 -m venv "$venv" 2>/dev/null || python3 -m venv "$venv"
fi
$py -m pip install -q --upgrade pip >/dev/null

# 1. CPU torch (never the CUDA build).
source scripts/_cpu_torch.sh
install_cpu_torch "$py"
torch_version=$($py -c "import torch; print(torch.__version__)")
constraints=$venv/constraints.txt
echo "torch==${torch_version}" >"$constraints"

# 2. LMCache itself, without letting pip resolve its requirements.
$py -m pip install -q --no-deps "lmcache==${lmcache_version}"

# 3. Its declared requirements, minus the CUDA-only and GCP/gRPC ones, and
#    minus torch (already the CPU build). Read from the installed metadata.
reqs=$venv/lmcache-requirements.txt
$py -m pip install -q packaging
$py - "$reqs" <<'EOF'
import re, sys
from importlib.metadata import requires
from packaging.requirements import Requirement

SKIP = re.compile(r"^(cupy.*|cuda-python|cufile.*|google-.*|grpcio-observability|torch|nvidia-.*|nixl.*)$", re.I)
keep = []
for line in requires("lmcache") or []:
    req = Requirement(line)
    if req.marker is not None and "extra" in str(req.marker):
        continue  # optional extras
    if SKIP.match(req.name):
        continue
    if req.marker is not None and not req.marker.evaluate():
        continue
    req.marker = None
    keep.append(str(req))
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
print("setup_lmcache: installing", len(keep), "requirements:", " ".join(keep))
EOF
$py -m pip install -q -c "$constraints" -r "$reqs"

# 4. transformers new enough for LMCache's imports on torch 2.13.
$py -m pip install -q -c "$constraints" "transformers>=5.4"

check
rm -f $venv/.kvengine-setup-*
touch "$stamp"
echo "setup_lmcache: $venv ready (torch $torch_version, lmcache $($py -c 'import importlib.metadata as m; print(m.version("lmcache"))'))"

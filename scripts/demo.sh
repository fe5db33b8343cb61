#!/usr/bin/env bash
# Set up .venv and run the main job on the embedded default tiers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh hf
exec .venv/bin/kvengine demo "$@"

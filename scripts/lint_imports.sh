#!/usr/bin/env bash
# Check the import-linter contracts in pyproject.toml. transports/ and integrations/ are installed as
# kvengine.transports / kvengine.integrations (package_dir), which import-linter cannot follow, so it
# runs over a staged tree of symlinks where they sit inside kvengine/ as they are imported.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
mkdir "$root/kvengine"
for f in kvengine/*; do ln -s "$PWD/$f" "$root/kvengine/"; done
ln -s "$PWD/transports" "$root/kvengine/transports"
ln -s "$PWD/integrations" "$root/kvengine/integrations"
cp pyproject.toml "$root/"
cd "$root" && PYTHONPATH="$root" "$OLDPWD/.venv/bin/lint-imports" --no-cache

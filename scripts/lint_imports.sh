#!/usr/bin/env bash
# Check the import-linter contracts in pyproject.toml. transports/ and integrations/ are installed as
# kvengine.transports / kvengine.integrations (package_dir), which import-linter cannot follow, so it
# runs over a staged tree of symlinks where they sit inside kvengine/ as they are imported.
set -euo pipefail
cd "$(dirname "$0")/.."
# import-linter sees `from kvengine import X` as an import of the package alone: the lazy re-exports of
# kvengine/__init__.py would hide which module X comes from, and so a broken layer. Package code imports
# from the defining module.
if grep -rnE '^[[:space:]]*from kvengine import ' kvengine transports integrations --include='*.py'; then
  echo "lint_imports: the lines above import through kvengine's lazy re-exports; import from the defining module" >&2
  exit 1
fi
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
mkdir "$root/kvengine"
for f in kvengine/*; do ln -s "$PWD/$f" "$root/kvengine/"; done
ln -s "$PWD/transports" "$root/kvengine/transports"
ln -s "$PWD/integrations" "$root/kvengine/integrations"
cp pyproject.toml "$root/"
cd "$root" && PYTHONPATH="$root" "$OLDPWD/.venv/bin/lint-imports" --no-cache

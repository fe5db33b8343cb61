"""scripts/lint_imports.sh fails on a deliberate violation of each kind it guards against (a contract that
cannot fail guards nothing): transports importing the engine, integrations importing a transport, the peer
wires importing another tier, and an import through the package's lazy re-exports."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "lint-imports").exists(), reason="import-linter not in .venv")
@pytest.mark.parametrize("path, line, says", [
    ("transports/_violation.py", "from kvengine.facade import KVEngine",
     "transports build on the foundation only: never the engine, the facade or what serves an engine BROKEN"),
    ("integrations/vllm/_violation.py", "import kvengine.transports.peers.tcp",
     "integrations reach the transports through the engine and kvengine.sharing, never directly BROKEN"),
    ("transports/peers/_violation.py", "import kvengine.transports.local_disk",
     "the tiers below memory are independent of each other: local disk, Mooncake Store, the peer wires BROKEN"),
    ("transports/_violation.py", "from kvengine import KVEngine", "import through kvengine's lazy re-exports"),
    ("kvengine/chunks/_violation.py", "    from kvengine import CacheEngine", "lazy re-exports"),
])
def test_a_deliberate_violation_fails_the_import_check(tmp_path, path, line, says):
    for part in ("kvengine", "transports", "integrations", "scripts"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    check = subprocess.run(["bash", str(tmp_path / "scripts" / "lint_imports.sh")], capture_output=True, text=True,
                           timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr  # the copy passes as it is
    indent = "def f():\n" if line.startswith(" ") else ""
    (tmp_path / path).write_text(f"{indent}{line}\n")
    check = subprocess.run(["bash", str(tmp_path / "scripts" / "lint_imports.sh")], capture_output=True, text=True,
                           timeout=120)
    assert check.returncode != 0
    assert says in " ".join((check.stdout + check.stderr).split())  # import-linter wraps long names


#: Package roots no contract needs to name: the public API's lazy re-exports (``kvengine``) and empty packages.
PACKAGE_ROOTS = {"kvengine", "kvengine.core", "kvengine.trust"}


def _contract_names() -> set[str]:
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    return {part.strip() for c in contracts for key in ("layers", "source_modules", "forbidden_modules", "modules")
            for entry in c.get(key, ()) for part in entry.split("|")}


def _modules() -> list[str]:
    """Every module of the distribution, by the name it is imported as."""
    out = []
    for folder, package in (("kvengine", "kvengine"), ("transports", "kvengine.transports"),
                            ("integrations", "kvengine.integrations")):
        for path in (ROOT / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            out.append(".".join([package, *parts]))
    return out


def test_every_module_is_under_some_import_contract():
    """A module that no contract names (itself or a package above it) may import anything: each new module must
    be placed in the layering."""
    named = _contract_names()
    modules = _modules()
    assert len(modules) > 100 and "kvengine.core.pins" in modules
    unplaced = [m for m in modules if m not in PACKAGE_ROOTS and not any(
        ".".join(m.split(".")[:i]) in named for i in range(2, m.count(".") + 2))]
    assert unplaced == []

"""The distribution lists every package of the source tree (a wheel built from ``pyproject.toml`` holds only
the packages it names: ``kvengine.host`` was once missing, which editable installs hide)."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_directory_is_in_the_distribution():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    roots = {name: ROOT / path for name, path in setuptools["package-dir"].items()}
    found = set()
    for name, path in roots.items():
        for init in path.rglob("__init__.py"):
            parts = init.parent.relative_to(path).parts
            found.add(".".join((name, *parts)))
    assert found - listed == set(), "packages missing from pyproject.toml [tool.setuptools] packages"
    assert listed - found == set(), "pyproject.toml lists packages that do not exist"

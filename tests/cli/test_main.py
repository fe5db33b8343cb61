"""The ``kvengine`` command itself: help, version, argument errors, ``python -m kvengine``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvengine.cli import main


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


def test_help_lists_commands_and_examples_without_importing_torch():
    """``kvengine --help`` names every command and shows examples; the command's import path loads neither
    torch nor the engine (that import is what made help take seconds)."""
    probe = ("import sys, runpy; sys.argv = ['kvengine', '--help']\n"
             "try:\n    runpy.run_module('kvengine', run_name='__main__')\nexcept SystemExit as e:\n"
             "    assert e.code == 0, e.code\n"
             "print('LOADED', sorted(m for m in ('torch', 'kvengine.facade', 'kvengine.core.engine') if m in sys.modules))")
    out = _run("-c", probe)
    assert out.returncode == 0, out.stderr
    for command in ("demo", "inspect", "serve", "quarantine", "stats", "top", "quickstart", "examples:"):
        assert command in out.stdout
    assert "LOADED []" in out.stdout


def test_version_and_python_dash_m():
    """``python -m kvengine --version`` prints the installed version and exits 0."""
    from importlib.metadata import version

    out = _run("-m", "kvengine", "--version")
    assert out.returncode == 0 and out.stdout.strip() == f"kvengine {version('kvengine')}"


@pytest.mark.parametrize(("args", "message"), [
    (["quickstart", "--chunk-size", "0"], "--chunk-size: expected a positive integer, got 0"),
    (["quickstart", "--tokens", "abc"], "--tokens: expected a positive integer, got 'abc'"),
    (["quickstart", "--tokens", "-5"], "--tokens: expected a positive integer, got -5"),
    (["no-such-command"], "invalid choice: 'no-such-command'"),
])
def test_user_errors_are_one_line_and_exit_2(capsys, args, message):
    """A bad argument is a usage error naming it (exit 2), never a traceback."""
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err

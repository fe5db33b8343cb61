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


def test_log_level_shows_the_start_up_line_and_a_line_per_lookup_and_load():
    """``kvengine --log-level debug quickstart``: one start-up line with the effective settings (chunk size,
    memory, tiers), then a debug line per lookup (hit tokens, chunks by tier) and per load; the chunk size
    typed on the command line wins over KVENGINE_CHUNK_SIZE. A level that does not exist is exit 2."""
    import os

    env = dict(os.environ, KVENGINE_CHUNK_SIZE="128")
    out = subprocess.run([sys.executable, "-m", "kvengine", "--log-level", "debug", "quickstart", "--tokens", "600",
                          "--chunk-size", "64"], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert "INFO kvengine: started: chunk 64 tokens; memory 64.0MiB (lru); lower tiers: none" in out.stderr
    assert "DEBUG kvengine: lookup request-2: 576 of 599 tokens hit, chunks by tier {'memory': 9}" in out.stderr
    assert "DEBUG kvengine: load request-2: 576 of 576 tokens loaded" in out.stderr
    bad = _run("-m", "kvengine", "--log-level", "loud", "quickstart")
    assert bad.returncode == 2 and "--log-level must be one of debug, info, warning, error" in bad.stderr


def test_missing_optional_dependency_or_bad_configuration_is_one_line():
    """``kvengine serve --transport zmq`` without pyzmq names the extra to install (exit 2); a configuration
    error reaching a command is one line (exit 2), never a traceback."""
    probe = ("import sys; sys.modules['zmq'] = None\n"
             "from kvengine.cli import main\n"
             "sys.exit(main(['serve', '--transport', 'zmq', '--bind', '127.0.0.1:0']))")
    out = _run("-c", probe)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "zmq is not installed; pip install 'kvengine[zmq]'" in out.stderr
    import os

    bad = subprocess.run([sys.executable, "-m", "kvengine", "quickstart", "--tokens", "300"], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, KVENGINE_MEMORY__EVICTION="arc"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "memory.eviction" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_every_public_name_resolves_lazily_from_the_module_that_defines_it():
    """The package's exports load on first use (PEP 562): every name in ``kvengine.__all__`` has a lazy entry
    and resolves to the object of the module it names, so the list, the lazy table and the type-checking
    imports cannot drift apart unnoticed."""
    import importlib

    import kvengine

    assert sorted(kvengine._EXPORTS) == sorted(kvengine.__all__)
    for name, module in kvengine._EXPORTS.items():
        assert getattr(kvengine, name) is getattr(importlib.import_module(module), name)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        kvengine.NoSuchName  # noqa: B018

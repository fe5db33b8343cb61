"""``kvengine serve`` and ``kvengine quarantine``: missing or malformed files are one line on stderr and exit 2;
every option has help text."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvengine.cli.quarantine import main as quarantine
from kvengine.cli.serve import main as serve


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(("files", "argv", "message"), [
    ({}, ["--secret-file", "{d}/missing"], "--secret-file {d}/missing: no such file"),
    ({"short": "abc"}, ["--secret-file", "{d}/short"], "holds 3 bytes"),
    ({}, ["--transport", "tcp", "--tls-cert", "{d}/missing"], "--tls-cert {d}/missing: no such file"),
    ({"cert.pem": "not a certificate"}, ["--transport", "tcp", "--tls-cert", "{d}/cert.pem"], "--tls-cert"),
    ({"cert": "not a certificate"}, ["--transport", "zmq", "--curve-cert", "{d}/cert"],
     "not a readable CURVE certificate"),
    ({"cert": "x"}, ["--transport", "zmq", "--curve-cert", "{d}/cert", "--curve-allow", "{d}/nodir"],
     "--curve-allow {d}/nodir: no such"),
    ({"cert": "x"}, ["--transport", "zmq", "--curve-cert", "{d}/cert", "--tenants", "{d}/missing.json"],
     "--tenants {d}/missing.json: no such file"),
    ({"cert": "x", "t.json": "{not json"}, ["--transport", "zmq", "--curve-cert", "{d}/cert", "--tenants",
                                           "{d}/t.json"], "tenants file {d}/t.json"),
])
def test_serve_file_errors_are_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   files: dict[str, str], argv: list[str], message: str) -> None:
    """A missing or malformed secret, certificate or tenants file is named on one stderr line (exit 2)."""
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    args = [a.format(d=tmp_path) for a in argv]
    assert serve(["--bind", "127.0.0.2:0", *args]) == 2
    assert message.format(d=tmp_path) in _one_line_error(capsys)


@pytest.mark.parametrize("argv", [["--capacity", "lots"], ["--transport", "quic"], ["--max-concurrent", "x"], []])
def test_serve_argument_errors_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    """A bad or missing argument is a usage error on one line (exit 2), not a usage block."""
    with pytest.raises(SystemExit) as info:
        serve(argv if not argv else ["--bind", "127.0.0.2:0", *argv])
    assert info.value.code == 2
    assert "kvengine serve:" in _one_line_error(capsys)


def test_quarantine_missing_disk_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``quarantine list|purge --disk`` on a missing directory says so on one line (exit 2)."""
    for action in (["list"], ["purge", "--all"]):
        assert quarantine([*action, "--disk", str(tmp_path / "nope")]) == 2
        assert f"--disk {tmp_path / 'nope'}: no such directory" in _one_line_error(capsys)


def test_quarantine_argument_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A missing --disk or action is a one-line usage error (exit 2)."""
    for argv in (["list"], []):
        with pytest.raises(SystemExit) as info:
            quarantine(argv)
        assert info.value.code == 2
        assert "kvengine quarantine" in _one_line_error(capsys)


def test_every_serve_option_has_help() -> None:
    """Every option of kvengine serve has help text."""
    from kvengine.cli.serve import build_parser

    assert [a.dest for a in build_parser()._actions if not a.help] == []


@pytest.mark.parametrize("argv", [["list", "--help"], ["purge", "--help"]])
def test_every_quarantine_option_has_help(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    """Every option of kvengine quarantine list/purge has help text."""
    with pytest.raises(SystemExit):
        quarantine(argv)
    out = capsys.readouterr().out
    assert "the disk tier's directory" in out
    if argv[0] == "purge":
        assert "roots to purge" in out and "purge every quarantined namespace" in out

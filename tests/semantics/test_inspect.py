"""``kvengine inspect``: per-group report from config.json alone; refusals exit 1 with the reason."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from kvengine.cli.inspect import main
from kvengine.integrations.hf.tiny_models import TINY_CONFIGS


def save(tmp_path, model_type, **kwargs):
    from transformers import AutoConfig

    AutoConfig.for_model(model_type, **kwargs).save_pretrained(tmp_path)
    return tmp_path


def test_hybrid_report_lists_groups_plans_and_sizes(tmp_path, capsys):
    """Scenario: a Qwen3-Next config dir -> a state group and a full group with bytes and plans."""
    model_type, kw, _ = TINY_CONFIGS["qwen3_next"]
    assert main([str(save(tmp_path, model_type, **kw)), "--chunk-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "group 0 (state, layers 0,2): LINEAR_STATE" in out
    assert "group 1 (full, layers 1,3): FULL_ATTENTION" in out
    assert "snapshot boundary only" in out and "per 1k tokens" in out


def test_json_from_config_file(tmp_path, capsys):
    """Scenario: config.json path, --json: bytes per token match the spec arithmetic."""
    model_type, kw, _ = TINY_CONFIGS["gemma3"]
    path = save(tmp_path, model_type, **kw) / "config.json"
    assert main([str(path), "--json", "--chunk-size", "16"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [g["category"] for g in rep["groups"]] == ["SLIDING_WINDOW", "FULL_ATTENTION"]
    assert rep["bytes_per_token"] == 3 * 2 * 2 * 16 * 4
    assert rep["storage_per_1k_tokens"] == 1000 * rep["bytes_per_token"]


@pytest.mark.parametrize(("model_type", "reason"), [
    ("zamba2", "shared across layers"),
    ("bert", "encoder-only"),
    ("gpt_neox", "not in kvengine's KV semantics registry"),
])
def test_refused_model_exits_1_with_reason(tmp_path, capsys, model_type, reason):
    """A refused model type exits 1 and prints REFUSED with the reason."""
    assert main([str(save(tmp_path, model_type))]) == 1
    out = capsys.readouterr().out
    assert "REFUSED" in out and reason in out


def test_unreadable_path_is_refused(tmp_path, capsys):
    """A path with no readable model config exits 1, saying so."""
    assert main([str(tmp_path / "nope")]) == 1
    assert "cannot read model config" in capsys.readouterr().out


def test_list_refused_prints_every_reason(capsys):
    """--list-refused exits 0 and prints every refused model kind with its reason."""
    from kvengine.semantics import refusal_reasons

    assert main(["--list-refused"]) == 0
    out = capsys.readouterr().out
    for what, why in refusal_reasons().items():
        assert f"{what}: {why}" in out


def test_missing_model_argument_is_a_usage_error():
    """No model argument is a usage error (exit 2)."""
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2

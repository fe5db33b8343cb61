"""``kvengine inspect``: per-group report and per-integration verdicts from config.json alone; refusals exit 1
with the reason, user errors exit 2 with one line."""

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


def _one_line_error(capsys) -> str:
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err and cap.out == ""
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1, cap.err
    return lines[0]


def verdicts(out: str) -> dict[str, str]:
    """The per-integration lines of the text report, by integration label."""
    lines = out.split("\nintegrations\n", 1)[1].splitlines()
    return {line.strip().split(":", 1)[0]: line.strip().split(":", 1)[1].strip() for line in lines if line.strip()}


def test_unreadable_path_is_a_user_error(tmp_path, capsys):
    """A path with no model config (missing file, directory without config.json) is one line on stderr, exit 2."""
    assert main([str(tmp_path / "nope")]) == 2
    assert "cannot read model config" in _one_line_error(capsys)
    assert main([str(tmp_path)]) == 2
    assert "config.json" in _one_line_error(capsys)


@pytest.mark.parametrize(("text", "message"), [
    ("{not json", "not valid JSON"),
    ('["llama"]', "has no model_type"),
    ('{"hidden_size": 8}', "has no model_type"),
    ('{"model_type": "llama", "num_attention_heads": "many"}', "transformers cannot build a 'llama' config"),
])
def test_malformed_config_is_a_user_error(tmp_path, capsys, text, message):
    """A config.json that is not JSON, has no model_type or holds values the spec cannot use: one line, exit 2."""
    (tmp_path / "config.json").write_text(text)
    assert main([str(tmp_path)]) == 2
    assert message in _one_line_error(capsys)


def test_unknown_model_type_suggests_close_names(tmp_path, capsys):
    """An unknown model_type is named with close matches, not transformers' list of every model type (exit 2)."""
    (tmp_path / "config.json").write_text('{"model_type": "lama"}')
    assert main([str(tmp_path)]) == 2
    line = _one_line_error(capsys)
    assert "model_type 'lama' is unknown to transformers; did you mean" in line and "'llama'" in line
    assert len(line) < 300


@pytest.mark.parametrize("dtype", ["fp8", "float8_e4m3fn", "int8"])
def test_unsupported_dtype_names_the_allowed_values(tmp_path, capsys, dtype):
    """--dtype outside float32/float16/bfloat16 is a one-line usage error (exit 2) naming the allowed values."""
    model_type, kw, _ = TINY_CONFIGS["llama"]
    with pytest.raises(SystemExit) as info:
        main([str(save(tmp_path, model_type, **kw)), "--dtype", dtype])
    assert info.value.code == 2
    line = _one_line_error(capsys)
    assert repr(dtype) in line and "float32, float16, bfloat16" in line


def test_llama_is_supported_by_every_integration(tmp_path, capsys):
    """Llama: the HF loop, the vLLM connector and the SGLang backend all accept it (vLLM and SGLang listing what
    they check at start-up); the per-group output is still there."""
    model_type, kw, _ = TINY_CONFIGS["llama"]
    assert main([str(save(tmp_path, model_type, **kw)), "--chunk-size", "16", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "FULL_ATTENTION" in out and "match at" in out
    v = verdicts(out)
    assert set(v) == {"HF generate loop", "vLLM connector", "SGLang HiCache backend"}
    assert all(text.startswith("supported:") for text in v.values()), v
    assert "CPU_ATTN" in v["vLLM connector"] and "MHATokenToKVPoolHost" in v["SGLang HiCache backend"]


def test_mla_is_decided_by_vllms_backend(tmp_path, capsys):
    """DeepSeek-V2 (MLA): the HF loop and SGLang (MLA host pool) accept it; the vLLM connector accepts its
    MLAAttentionSpec pages on the AMX_MLA backend and refuses the reference CPU_MLA backend, which vLLM picks
    at start-up by CPU: checked at start-up."""
    model_type, kw, _ = TINY_CONFIGS["deepseek_v2"]
    assert main([str(save(tmp_path, model_type, **kw)), "--chunk-size", "16"]) == 0
    v = verdicts(capsys.readouterr().out)
    assert v["HF generate loop"].startswith("supported:")
    assert v["vLLM connector"].startswith("checked at start-up:")
    assert "AMX_MLA" in v["vLLM connector"] and "CPU_MLA" in v["vLLM connector"]
    assert v["SGLang HiCache backend"].startswith("supported:") and "MLATokenToKVPool" in v["SGLang HiCache backend"]


@pytest.mark.parametrize(("name", "vllm", "sglang"), [
    ("qwen3_next", "supported:", "refused:"),  # GDN state: vLLM's GDN_ATTN is validated (in 'align' mode)
    ("granitemoehybrid", "refused:", "refused:"),  # Mamba2 state: not a validated vLLM state backend
    ("gemma2", "supported:", "checked at start-up:"),  # sliding window: SGLang's pool choice decides
    ("t5", "refused:", "checked at start-up:"),  # encoder-decoder: check_vllm_config refuses it
])
def test_hybrid_and_other_verdicts(tmp_path, capsys, name, vllm, sglang):
    """Hybrids, sliding window and encoder-decoder models get what each integration really does with them."""
    model_type, kw, _ = TINY_CONFIGS[name]
    assert main([str(save(tmp_path, model_type, **kw)), "--chunk-size", "16"]) == 0
    v = verdicts(capsys.readouterr().out)
    assert v["HF generate loop"].startswith("supported:")
    assert v["vLLM connector"].startswith(vllm), v
    assert v["SGLang HiCache backend"].startswith(sglang), v
    if name == "qwen3_next":
        assert "mamba_cache_mode 'align'" in v["vLLM connector"]
        assert "register_mem_host_pool_v2" in v["SGLang HiCache backend"]


def test_json_lists_the_verdicts(tmp_path, capsys):
    """--json carries one verdict object per integration."""
    model_type, kw, _ = TINY_CONFIGS["deepseek_v2"]
    assert main([str(save(tmp_path, model_type, **kw)), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [(v["integration"], v["verdict"]) for v in rep["integrations"]] == [
        ("hf", "supported"), ("vllm", "checked at start-up"), ("sglang", "supported")]


def test_hf_verdict_uses_the_derivation_attach_uses():
    """Drift guard: the HF verdict is built from derive_spec, the very function attach() calls."""
    from kvengine.integrations.hf import attaching
    from kvengine.semantics import derive_spec

    assert attaching.derive_spec is derive_spec


def test_vllm_verdict_mirrors_the_connector_checks():
    """Drift guard: the spec classes, backends and refusals the vLLM verdict encodes are those of
    integrations/vllm/layout.py and connector.py (read as text: vLLM is not installed here)."""
    from pathlib import Path

    from kvengine.cli import inspect
    from kvengine.integrations.vllm import layout

    root = Path(layout.__file__).parent
    text = (root / "layout.py").read_text()
    assert "(supported: {SUPPORTED_SPECS})" in text
    accepted = ("FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec", "ChunkedLocalAttentionSpec", "MambaSpec")
    assert all(f"if type(spec) is {name}:" in text and name in layout.SUPPORTED_SPECS for name in accepted)
    assert text.count("if type(spec) is ") == len(accepted)  # every other class is refused
    assert {"AMX_MLA", "CPU_ATTN"} == layout.ATTENTION_BACKENDS and "CPU_MLA" in layout.REFUSED_BACKENDS
    assert layout.STATE_BACKENDS == {"GDN_ATTN"}
    assert [k for k, b in inspect._VLLM_STATE_BACKEND.items() if b in layout.STATE_BACKENDS] == ["gated_delta_net"]
    assert "is_encoder_decoder" in (root / "connector.py").read_text()


def test_sglang_verdict_mirrors_the_backend_checks():
    """Drift guard: the SGLang verdict's pools match integrations/sglang (pages.PoolKind, the hybrid refusal)."""
    from pathlib import Path

    from kvengine.integrations.sglang import pages

    assert {k.value for k in pages.PoolKind} == {"MHATokenToKVPoolHost", "MLATokenToKVPoolHost"}
    backend = (Path(pages.__file__).parent / "backend.py").read_text()
    assert "def register_mem_host_pool_v2" in backend and "raise UnsupportedModelError(_HYBRID_REFUSAL" in backend


def test_help_describes_every_option(capsys):
    """Every option of kvengine inspect has help text; those with a default name it."""
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "(default 256)" in out and "float32, float16, bfloat16" in out and "as JSON" in out


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

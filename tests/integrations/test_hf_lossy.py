"""Lossy codecs through ``attach``: an explicit opt-in, a canary that measures the lossy hit, no less strictness.

The engines here have a real disk tier in ``tmp_path`` whose records are
written with a lossy codec (``int8-channel`` unless said otherwise). The
memory tier still holds exact KV, so a hit is exact (memory) or lossy (disk):
the canary checks the exact restore as strictly as ever and a restore through
the codec against the codec's error bound, and reports the lossy
continuation's error.
"""

from __future__ import annotations

import logging
import math

import pytest

pytest.importorskip("transformers")

from kvengine import AttachError, InvalidRequestError
from kvengine.compression import error_bound
from kvengine.integrations.hf import attach
from kvengine.integrations.hf import verify as verify_mod
from kvengine.integrations.hf.codec import Restorer
from kvengine.integrations.hf.runner import ModelRunner
from kvengine.semantics.canary import CanaryReport
from kvengine.trust.provenance import CanaryOutcome

from .conftest import CHUNK, make_engine, prompt_for
from .test_hf_canary import _positions_restart_after_restore, _token_major_copy, only_canary, spy_bindings

LOSSY = "int8-channel"


def lossy_engine(tmp_path, codec: str = LOSSY, **extra: object):
    return make_engine(disk={"path": str(tmp_path / "disk"), "codec": codec}, **extra)


def test_lossy_engine_without_the_flag_is_refused_naming_it(tmp_path, tiny_llama):
    """Scenario: the disk tier writes int8-channel records and attach is called without lossy_kv. attach
    raises InvalidRequestError naming the codec and the flag before anything is bound (no canary either)."""
    with lossy_engine(tmp_path) as engine:
        bound = spy_bindings(engine)
        with pytest.raises(InvalidRequestError, match=r"lossy codec 'int8-channel'.*lossy_kv=True"):
            attach(tiny_llama, engine)
        assert bound == []


@pytest.mark.parametrize("disk", [None, "raw", "zstd-byteshuffle"], ids=["memory-only", "raw", "zstd"])
def test_flag_on_a_lossless_engine_is_refused(tmp_path, tiny_llama, disk):
    """Scenario: lossy_kv=True on an engine whose tiers are lossless (or absent). attach raises
    InvalidRequestError saying there is nothing lossy to opt into; nothing is bound."""
    extra = {} if disk is None else {"disk": {"path": str(tmp_path / "disk"), "codec": disk}}
    with make_engine(**extra) as engine:
        bound = spy_bindings(engine)
        with pytest.raises(InvalidRequestError, match="nothing lossy to opt into"):
            attach(tiny_llama, engine, lossy_kv=True)
        assert bound == []


@pytest.mark.parametrize("codec", [LOSSY, "fp8-token", "int4-channel"])
def test_lossy_canary_passes_and_reports_a_bounded_error(tmp_path, caplog, tiny_llama, codec):
    """Scenario: lossy_kv=True on a lossy disk engine. The model binds in the codec's family, the exact
    restore is as exact as on the lossless path, the restore through the codec is off by a non-zero error
    within the codec's bound, and the lossy continuation's logit error and greedy agreement are reported
    on AttachedModel.canary and in one log line."""
    with lossy_engine(tmp_path, codec) as engine, caplog.at_level(logging.INFO, logger="kvengine.hf"):
        am = attach(tiny_llama, engine, lossy_kv=True)
    report = am.canary
    assert isinstance(report, CanaryReport) and report.passed and report.lossy
    assert am.namespace.codec_family == f"lossy:{codec}"
    assert report.codec == codec and report.restored_exact and report.max_logit_error <= 1e-5
    assert report.restored_bound == error_bound(engine.lossy_codec)  # type: ignore[arg-type]
    assert 0 < report.restored_error <= report.restored_bound
    assert report.lossy_logit_error is not None and 0 < report.lossy_logit_error < math.inf
    assert report.lossy_greedy_agreement is not None and 0 <= report.lossy_greedy_agreement <= 1
    lines = [r.getMessage() for r in caplog.records if "attach canary passed" in r.getMessage()]
    assert len(lines) == 1 and f"lossy codec {codec}" in lines[0] and "continuation max logit error" in lines[0]
    print(f"{codec}: restored error {report.restored_error:.3g} (bound {report.restored_bound:.3g}), "
          f"logit error {report.lossy_logit_error:.3g}, greedy agreement {report.lossy_greedy_agreement:.2f}")


def test_lossy_hit_from_disk_through_a_fresh_engine(tmp_path, tiny_llama):
    """Scenario: one engine attaches with lossy_kv=True and stores a prompt's chunks to the int8-channel disk;
    a fresh engine on the same disk attaches the same model and generates from that prompt. The namespace
    canary accepts the lossy probe record (within the codec's bound, not quarantined), the prefix is reused
    from disk (a lossy hit), and its greedy output is compared with a plain run and reported, not asserted
    equal (lossy KV may change tokens)."""
    ids, _ = prompt_for(tiny_llama, 3 * CHUNK + 5)
    with lossy_engine(tmp_path) as first:
        writer = attach(tiny_llama, first, lossy_kv=True)
        assert writer.generate(ids, max_new_tokens=1).stored_chunks == 3
    with lossy_engine(tmp_path) as fresh:
        reader = attach(tiny_llama, fresh, lossy_kv=True)
        assert reader.proof is not None and reader.proof.serving
        assert reader.proof.outcome in (CanaryOutcome.EXACT, CanaryOutcome.CLOSE)
        disk_reads = fresh.metrics.loaded_bytes.labels(tier=fresh._core.transports[0].name)
        before = disk_reads._value.get()
        plain = reader.generate(ids, max_new_tokens=8, use_cache=False, store=False)
        hit = reader.generate(ids, max_new_tokens=8, store=False)
        assert disk_reads._value.get() > before  # the hit's chunks came from the int8-channel disk records
    assert hit.load_ok and hit.reused_tokens == 3 * CHUNK and hit.computed_tokens == 5
    agree = sum(a == b for a, b in zip(hit.new_tokens, plain.new_tokens))
    print(f"lossy hit vs plain run: {agree}/{len(plain.new_tokens)} greedy tokens agree "
          f"({hit.new_tokens} vs {plain.new_tokens})")
    assert len(hit.new_tokens) == len(plain.new_tokens) == 8


def _flipped_tokens(codec, view):
    """Fault on the lossy path only: the codec round trip returns each chunk's tokens in reverse order."""
    back = _real_through(codec, view)
    return back.__class__(back.index, back.key, back.token_range,
                          tuple(t.flip(1) if t.dim() == 3 else t for t in back.tensors), back.layout)


_real_through = verify_mod.through_codec

LOSSY_FAULTS = [
    pytest.param(Restorer, "copy_attention", _token_major_copy, "restored cache differs", id="wrong-layout"),
    pytest.param(ModelRunner, "forward", _positions_restart_after_restore, "cached continuation differs",
                 id="wrong-positions"),
    pytest.param(verify_mod, "through_codec", _flipped_tokens, f"restored through codec {LOSSY}",
                 id="wrong-layout-on-the-lossy-path"),
]


@pytest.mark.parametrize(("owner", "attr", "fault", "what"), LOSSY_FAULTS)
def test_injected_fault_is_refused_under_the_lossy_canary(monkeypatch, tmp_path, tiny_llama, owner, attr, fault,
                                                          what):
    """Scenario: a layout or position bug is present at a lossy attach (in the shared restore path, or only in
    the restore through the codec). The canary refuses it with AttachError naming the group, and binds nothing
    but its own canary namespace: a codec's quantization error never hides such a bug."""
    monkeypatch.setattr(owner, attr, fault)
    with lossy_engine(tmp_path) as engine:
        bound = spy_bindings(engine)
        with pytest.raises(AttachError, match="nothing will be served") as info:
            attach(tiny_llama, engine, lossy_kv=True)
        assert "group 0 (full, layers 0-1)" in str(info.value) and what in str(info.value)
        assert only_canary(bound)

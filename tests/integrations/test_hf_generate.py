"""The generate loop's behaviour around the cache: partial loads, limits, stores, eviction."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kvengine import InvalidRequestError
from kvengine.integrations.hf import attach
from kvengine.integrations.hf.codec import Restorer

from .conftest import CHUNK, build_tiny, make_engine, prompt_for, reference_generate


@pytest.mark.parametrize(("family", "expect_reused"), [("llama", CHUNK), ("mistral", 0), ("mamba2", 0)])
def test_failed_chunk_is_recomputed_and_output_stays_exact(monkeypatch, family, expect_reused):
    """Scenario: the load sink fails on chunk 1 of 3. Full attention resumes after chunk 0; windowed and
    stateful models (whose restore needs the reserved end) recompute everything. Output is exact either way."""
    model = build_tiny(family)
    ids, _ = prompt_for(model, 3 * CHUNK + 4, seed=11)
    want = reference_generate(model, ids, None, 10)
    with make_engine() as engine:
        am = attach(model, engine)
        am.generate(ids, max_new_tokens=1)
        real_call = Restorer.__call__

        def flaky(self, view):
            if view.index == 1:
                raise OSError("simulated tier read failure")
            real_call(self, view)

        monkeypatch.setattr(Restorer, "__call__", flaky)
        out = am.generate(ids, max_new_tokens=10, eos_token_id=None)
    assert not out.load_ok
    assert out.reused_tokens == expect_reused
    assert list(out.new_tokens) == want


def test_at_least_one_token_is_always_computed(tiny_llama):
    """Scenario: a prompt of exactly 2 chunks, both cached, still prefills its last token (1 chunk reused)."""
    ids, _ = prompt_for(tiny_llama, 2 * CHUNK, seed=12)
    with make_engine() as engine:
        am = attach(tiny_llama, engine)
        am.generate(ids, max_new_tokens=1)
        again = am.generate(ids, max_new_tokens=1)
    assert again.reused_tokens == CHUNK and again.computed_tokens == CHUNK


def test_eos_stops_generation(tiny_llama):
    """Scenario: the first greedy token is declared EOS; generation stops after it."""
    ids, _ = prompt_for(tiny_llama, 20, seed=13)
    with make_engine() as engine:
        am = attach(tiny_llama, engine)
        first = am.generate(ids, max_new_tokens=1).new_tokens[0]
        out = am.generate(ids, max_new_tokens=10, eos_token_id=first)
    assert out.new_tokens == (first,)


def test_use_cache_false_and_store_false(tiny_llama):
    """Scenario: a plain run neither reads nor writes the cache."""
    ids, _ = prompt_for(tiny_llama, 40, seed=14)
    with make_engine() as engine:
        am = attach(tiny_llama, engine)
        plain = am.generate(ids, max_new_tokens=3, use_cache=False, store=False)
        assert plain.stored_chunks == 0 and plain.reused_tokens == 0 and plain.restore_s == 0.0
        assert am.generate(ids, max_new_tokens=3).reused_tokens == 0  # nothing was stored


def test_invalid_requests_raise(tiny_llama):
    """max_new_tokens=0, an empty prompt, or encoder inputs to a decoder-only model raise, naming the problem."""
    with make_engine() as engine:
        am = attach(tiny_llama, engine)
        with pytest.raises(InvalidRequestError, match="max_new_tokens"):
            am.generate([5, 6, 7], max_new_tokens=0)
        with pytest.raises(InvalidRequestError, match="non-empty"):
            am.generate([], max_new_tokens=1)
        with pytest.raises(InvalidRequestError, match="decoder-only"):
            am.generate([5, 6, 7], encoder_input_ids=[1, 2], max_new_tokens=1)


def test_full_memory_tier_degrades_to_misses(tiny_llama):
    """Scenario: a tier too small for more than a few chunks; requests stay exact, some just miss."""
    layout_bytes = 16 * 2 * 2 * 2 * 16 * 4  # one llama chunk
    with make_engine(capacity=4 * layout_bytes, memory={"capacity_bytes": 4 * layout_bytes,
                                                        "slab_bytes": layout_bytes}) as engine:
        am = attach(tiny_llama, engine)
        for seed in range(3):
            ids, _ = prompt_for(tiny_llama, 3 * CHUNK + 1, seed=20 + seed)
            want = reference_generate(tiny_llama, ids, None, 5)
            assert list(am.generate(ids, max_new_tokens=5, eos_token_id=None).new_tokens) == want
            assert list(am.generate(ids, max_new_tokens=5, eos_token_id=None).new_tokens) == want


def test_bf16_llama_hit_matches_plain_run():
    """Scenario: bf16 full attention is exact too (same kernels, same order): identical greedy tokens."""
    model = build_tiny("llama", dtype=torch.bfloat16)
    ids, _ = prompt_for(model, 50, seed=15)
    with make_engine() as engine:
        am = attach(model, engine)
        plain = am.generate(ids, max_new_tokens=12, use_cache=False, store=False, eos_token_id=None)
        am.generate(ids, max_new_tokens=1)
        hit = am.generate(ids, max_new_tokens=12, eos_token_id=None)
    assert hit.reused_tokens == 48 and hit.new_tokens == plain.new_tokens


def test_chunks_survive_an_engine_restart_on_disk(tmp_path, tiny_llama):
    """Scenario: a disk-backed engine stores a prompt; a new engine on the same directory serves it exactly."""
    ids, _ = prompt_for(tiny_llama, 3 * CHUNK + 3, seed=30)
    want = reference_generate(tiny_llama, ids, None, 6)
    cfg = {"disk": {"path": str(tmp_path)}, "write_mode": "write_through"}
    with make_engine(**cfg) as engine:
        attach(tiny_llama, engine).generate(ids, max_new_tokens=1)
    with make_engine(**cfg) as engine:
        out = attach(tiny_llama, engine).generate(ids, max_new_tokens=6, eos_token_id=None)
    assert out.reused_tokens == 3 * CHUNK
    assert list(out.new_tokens) == want


@pytest.mark.parametrize("family", ["llama", "mamba2"])
def test_reuse_works_under_inference_mode(family):
    """Scenario: the caller runs under ``torch.inference_mode()`` (how most people infer). The cached prefix
    is still loaded (restore buffers and state copies are written on the engine's thread), and the output
    equals a plain run."""
    model = build_tiny(family)
    ids, _ = prompt_for(model, 2 * CHUNK + 4, seed=21)
    want = reference_generate(model, ids, None, 6)
    with make_engine() as engine, torch.inference_mode():
        am = attach(model, engine)
        am.generate(ids, max_new_tokens=1)
        out = am.generate(ids, max_new_tokens=6, eos_token_id=None)
        failed = engine.metrics.value("kvengine_load_failed_tokens_total")
    assert out.load_ok and failed == 0
    assert out.reused_tokens == 2 * CHUNK
    assert list(out.new_tokens) == want

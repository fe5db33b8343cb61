"""Fail-closed attach: injected restore faults are refused by the canary, naming the layer group.

Each scenario breaks one thing a real integration bug could break (layout,
positions, a state tensor, sliding-window bookkeeping, the spec itself) and
checks that :func:`attach` raises, names the group, and binds nothing. The
debug override is explicit, loud, and its chunks never reach verified readers.
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("transformers")

from kvengine import AttachError, UnsupportedModelError
from kvengine.integrations.hf import attach
from kvengine.integrations.hf.codec import Restorer
from kvengine.integrations.hf.runner import ModelRunner
from kvengine.integrations.hf.tiny_models import TINY_CONFIGS
from kvengine.integrations.hf.verify import CANARY_KEY

from .conftest import build_tiny, make_engine, prompt_for


def spy_bindings(engine) -> list:
    """Record every namespace bound on ``engine``."""
    bound: list = []
    real = engine.bind

    def bind(namespace, layout):
        bound.append(namespace)
        return real(namespace, layout)

    engine.bind = bind
    return bound


def only_canary(bound: list) -> bool:
    """Nothing but canary namespaces was bound: the model is not served."""
    return bool(bound) and all(CANARY_KEY in ns.extra_keys for ns in bound)


def _token_major_copy(self, buf, layer, k, v, at):
    """Fault: read a [heads, tokens, dim] chunk as if it were [tokens, heads, dim]."""
    n = k.shape[1]
    k = k.reshape(k.shape[1], k.shape[0], k.shape[2]).transpose(0, 1)
    v = v.reshape(v.shape[1], v.shape[0], v.shape[2]).transpose(0, 1)
    buf.keys[0, :, at : at + n, :].copy_(k)
    buf.values[0, :, at : at + n, :].copy_(v)


def _layers_reversed(self, buf, layer, k, v, at):
    """Fault: chunk tensors written to the wrong layer (layer order reversed)."""
    layers = sorted(self._attn)
    target = self._attn[layers[len(layers) - 1 - layers.index(layer)]]
    n = k.shape[1]
    target.keys[0, :, at : at + n, :].copy_(k)
    target.values[0, :, at : at + n, :].copy_(v)


def _drop_recurrent_state(self, layer, index, st):
    """Fault: restore the conv window but forget the recurrent state."""
    for j, conv in enumerate(st.conv_shapes):
        if conv is not None:
            self.install_conv(layer, index, j)
        layer.has_previous_state[j] = True


def _zero_recurrent_state(self, layer, index, st):
    """Fault: allocate the recurrent state but never copy the snapshot into it (zeros)."""
    for j, (conv, rec) in enumerate(zip(st.conv_shapes, st.recurrent_shapes)):
        if conv is not None:
            self.install_conv(layer, index, j)
        if rec is not None:
            layer.lazy_initialization(recurrent_states=self._state[(index, j, "rec")][None], state_idx=j)
        layer.has_previous_state[j] = True


def _window_length_is_tokens_held(self, layer, k, v, total):
    """Fault: set a sliding layer's cumulative_length to the tokens it holds, not the prefix length."""
    original_install(self, layer, k, v, total)
    if hasattr(layer, "cumulative_length"):
        layer.cumulative_length = k.shape[-2]


original_install = Restorer.install_attention
original_forward = ModelRunner.forward


def _positions_restart_after_restore(self, ids, cache, start, **kw):
    """Fault: the suffix after a restored prefix is prefilled from position 0."""
    return original_forward(self, ids, cache, 0 if start > 0 else start, **kw)


FAULTS = [
    pytest.param("llama", Restorer, "copy_attention", _token_major_copy, "group 0 (full, layers 0-1)",
                 id="wrong-layout-gqa"),
    pytest.param("deepseek_v3", Restorer, "copy_attention", _layers_reversed, "group 0 (mla, layers 0-1)",
                 id="wrong-layer-order-mla"),
    pytest.param("llama", ModelRunner, "forward", _positions_restart_after_restore, "group 0 (full, layers 0-1)",
                 id="wrong-positions"),
    pytest.param("mamba2", Restorer, "install_state", _drop_recurrent_state, "group 0 (state, layers 0-1)",
                 id="dropped-state-mamba2"),
    pytest.param("granitemoehybrid", Restorer, "install_state", _drop_recurrent_state, "group 0 (state, layers 0,2)",
                 id="dropped-state-hybrid"),
    pytest.param("falcon_h1", Restorer, "install_state", _drop_recurrent_state, "(state, layers 0-1)",
                 id="dropped-state-parallel-hybrid"),
    pytest.param("qwen3_next", Restorer, "install_state", _zero_recurrent_state, "group 0 (state, layers 0,2)",
                 id="zeroed-state-gated-delta-net", marks=pytest.mark.slow),
    pytest.param("mistral", Restorer, "install_attention", _window_length_is_tokens_held,
                 "group 0 (sliding, layers 0-1)", id="wrong-window-length-mistral"),
    pytest.param("gemma3", Restorer, "install_attention", _window_length_is_tokens_held,
                 "group 0 (sliding, layers 0-1)", id="wrong-window-length-gemma3"),
]


@pytest.mark.parametrize(("family", "owner", "attr", "fault", "group"), FAULTS)
def test_injected_fault_is_refused_naming_the_group(monkeypatch, family, owner, attr, fault, group):
    """Scenario: a restore bug is present at attach; AttachError names the group and nothing is bound."""
    model = build_tiny(family)
    monkeypatch.setattr(owner, attr, fault)
    with make_engine() as engine:
        bound = spy_bindings(engine)
        with pytest.raises(AttachError, match="nothing will be served") as info:
            attach(model, engine)
        assert group in str(info.value)
        assert only_canary(bound)


def test_spec_window_disagreeing_with_the_model_is_refused(monkeypatch):
    """Scenario: the spec says window 16 but the model's cache uses 12: refused before any chunk is written."""
    import dataclasses

    from kvengine.integrations.hf import attaching as attach_mod

    real = attach_mod.derive_spec

    def wrong_window(config, **kw):
        spec = real(config, **kw)
        layers = tuple(
            dataclasses.replace(ls, attention=dataclasses.replace(ls.attention, window=16))
            if ls.attention is not None and ls.attention.window else ls
            for ls in spec.layers
        )
        return dataclasses.replace(spec, layers=layers)

    monkeypatch.setattr(attach_mod, "derive_spec", wrong_window)
    with make_engine() as engine:
        bound = spy_bindings(engine)
        with pytest.raises(UnsupportedModelError, match="window 12 disagrees with spec window 16"):
            attach(build_tiny("mistral"), engine)
        assert all(CANARY_KEY in ns.extra_keys for ns in bound)


def test_canary_passes_and_reports_for_a_healthy_model(tiny_llama):
    """Scenario: an unmodified model attaches; the report shows an exact restore and a tiny logit error."""
    from kvengine.integrations.hf import run_canary

    with make_engine() as engine:
        am = attach(tiny_llama, engine)
        report = run_canary(am)
        assert report.passed and report.restored_exact
        assert report.max_logit_error == 0.0  # bitwise: the reference is split where the cached path is
        assert am.namespace.verified and am.binding is not None


def test_debug_override_is_loud_and_isolated(monkeypatch, caplog, tiny_llama):
    """Scenario: debug_unverified binds a faulty restore, logs loudly, and verified readers never see its chunks."""
    ids, _ = prompt_for(tiny_llama, 40)
    with make_engine() as engine:
        monkeypatch.setattr(Restorer, "copy_attention", _token_major_copy)
        with caplog.at_level(logging.WARNING):
            unverified = attach(tiny_llama, engine, debug_unverified=True)
        assert "ATTACH VERIFICATION SKIPPED" in caplog.text
        assert not unverified.namespace.verified
        assert unverified.generate(ids, max_new_tokens=2).stored_chunks == 2
        assert unverified.generate(ids, max_new_tokens=2).reused_tokens == 32  # it reads its own chunks

        monkeypatch.undo()
        verified = attach(tiny_llama, engine)
        assert verified.namespace.verified
        result = verified.generate(ids, max_new_tokens=2)
        assert result.reused_tokens == 0  # the unverified chunks are in another namespace


def test_canary_whose_load_fails_is_refused_not_crashed(monkeypatch, tiny_llama):
    """Scenario: every load sink call fails during the attach canary (a broken restore path). attach raises
    AttachError saying the canary's load failed, not a TypeError from an empty cache, and binds nothing."""
    def broken(self, view):
        raise RuntimeError("simulated sink failure")

    monkeypatch.setattr(Restorer, "__call__", broken)
    with make_engine() as engine:
        bound = spy_bindings(engine)
        with pytest.raises(AttachError, match="load failed"):
            attach(tiny_llama, engine)
        assert only_canary(bound)


def _rounds_by_piece_length(amplitude: float):
    """A forward hook whose output depends on the length of the piece it runs on, by ``amplitude`` relative:
    what a kernel's rounding does (its blocking and accumulation order follow the shapes it is given)."""
    def hook(module, args, out):
        return out * (1 + amplitude * (out.shape[1] % 7) / 7)
    return hook


def test_qwen3_next_split_prefill_rounding_is_served_not_refused():
    """Regression (refuses where it should serve): the canary compared the cached continuation with one
    unsplit prefill under an fp32 bound measured on one CPU (2e-5 + 2e-6 x max), and refused Qwen3-Next
    (4 layers, linear attention every other layer) with "tensor 0: max abs error 2.82e-05" at the attention
    layer after a linear one: the size of transformers' own split-prefill rounding for that family on AVX2.
    Simulated here: the linear-attention layers round by 3e-5 depending on the piece length. The canary's
    reference is now a plain run split at the same boundaries, so it is bitwise equal and the model attaches."""
    model = build_tiny("qwen3_next")
    for layer in model.model.layers:
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.register_forward_hook(_rounds_by_piece_length(3e-5))
    with make_engine() as engine:
        am = attach(model, engine)
        assert am.canary is not None and am.canary.passed
        assert am.canary.max_logit_error == 0.0


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_the_cached_continuation_is_bitwise_equal_to_a_plain_run_split_at_the_same_boundaries(family):
    """Scenario: every family of the zoo attaches with a canary that allows no rounding at all: the cached
    continuation equals, bit for bit, plain transformers split where the cached path splits."""
    with make_engine() as engine:
        report = attach(build_tiny(family), engine).canary
        assert report is not None and report.passed and report.restored_exact
        assert report.max_logit_error == 0.0 and report.logit_bound == 0.0

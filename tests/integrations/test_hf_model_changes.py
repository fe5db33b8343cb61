"""A model that changes under an ``AttachedModel`` (weights, dtype, device): every public path follows it.

The check lives where every request passes: :meth:`AttachedModel.context`
(the binding a request uses) and each building block (``restore``,
``prefill``, ``store``). Changed weights move to their own namespace, a new
dtype re-derives the KV layout and re-runs the attach canary, a context made
before a change is refused, and a change that cannot be followed refuses
every request by name. Never stale KV, never a bare ``RuntimeError``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("transformers")

from kvengine import AttachError, InvalidRequestError
from kvengine.errors import ModelChangedError
from kvengine.integrations.hf import attach
from kvengine.integrations.hf.codec import Restorer

from .conftest import CHUNK, build_tiny, make_engine, prompt_for, reference_generate
from .test_hf_canary import _token_major_copy

PROMPT = 5 * CHUNK + 5  # 80 tokens of full chunks


def float32_state(model) -> dict[str, torch.Tensor]:
    """A copy of every parameter and buffer, to put back after a round trip through bfloat16 (which rounds
    them, RoPE's non-persistent ``inv_freq`` included)."""
    return {name: t.detach().clone() for name, t in itertools.chain(model.named_parameters(), model.named_buffers())}


def back_to(model, state: dict[str, torch.Tensor]) -> None:
    model.to(torch.float32)
    with torch.no_grad():
        for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
            t.copy_(state[name])


def plain_last_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The last position's logits of one plain transformers forward (no kvengine)."""
    with torch.no_grad():
        return model(ids[None]).logits[0, -1].float()


def test_restore_after_an_in_place_weights_change_serves_nothing_stale():
    """Regression (stale KV through a building block): ``restore`` did not re-check the weights, so after
    ``k_proj.weight.mul_(1.5)`` it reused 80 tokens of the old weights' KV and ``prefill`` over them was off
    by 1.6 in the last logit. Now ``context()`` follows the change first: the restore misses, and the
    logits are those of plain transformers on the new weights."""
    model = build_tiny("llama", seed=3)
    ids, _ = prompt_for(model, PROMPT, seed=1)
    with make_engine() as engine:
        am = attach(model, engine)
        am.generate(ids, max_new_tokens=1)
        with torch.no_grad():
            model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
        ctx = am.context()
        cache, reused, ok = am.restore(ctx, ids, "r")
        logits = am.prefill(ctx, ids, cache, reused, None)
        assert ok and reused == 0
        assert torch.allclose(logits[-1].float(), plain_last_logits(model, ids), atol=1e-5, rtol=0)
        assert engine.metrics.value("kvengine_namespace_changes_total") == 1


def test_a_change_of_a_non_persistent_buffer_is_a_new_namespace():
    """Regression: the content digest hashed ``state_dict()``, which leaves out non-persistent buffers such as
    RoPE's ``inv_freq``: an in-place change of it (or its rounding by a trip through bfloat16) kept the
    namespace, and the old KV (keys rotated with the old frequencies) was served. Now it is part of the
    digest: nothing is reused, and the tokens are plain transformers' on the changed model."""
    model = build_tiny("llama", seed=10)
    ids, _ = prompt_for(model, PROMPT, seed=8)
    with make_engine() as engine:
        am = attach(model, engine)
        am.generate(ids, max_new_tokens=1)
        with torch.no_grad():
            model.model.rotary_emb.inv_freq.mul_(1.5)
        want = reference_generate(model, ids, None, 6)
        out = am.generate(ids, max_new_tokens=6, eos_token_id=None)
        assert out.reused_tokens == 0 and list(out.new_tokens) == want


def test_a_context_made_before_a_weights_change_is_refused_by_every_building_block():
    """Regression: a context taken before the weights changed still named the old namespace, so ``restore``
    served the old KV and ``store`` would file the new weights' KV under the old namespace. Each building
    block now refuses it (InvalidRequestError saying to call context() again); a fresh context works."""
    model = build_tiny("llama", seed=4)
    ids, _ = prompt_for(model, PROMPT, seed=2)
    with make_engine() as engine:
        am = attach(model, engine)
        am.generate(ids, max_new_tokens=1)
        old_ctx = am.context()
        with torch.no_grad():
            model.model.layers[1].self_attn.v_proj.weight.add_(0.05)
        cache = am.codec.new_cache()
        for call in (lambda: am.restore(old_ctx, ids, "old"),
                     lambda: am.prefill(old_ctx, ids, cache, 0, None),
                     lambda: am.store(old_ctx, ids, cache, {})):
            with pytest.raises(InvalidRequestError, match=r"call context\(\) again"):
                call()
        ctx = am.context()
        _, reused, _ = am.restore(ctx, ids, "new")
        assert reused == 0


def test_a_dtype_change_after_attach_re_derives_the_layout_and_serves_exact_tokens():
    """Regression (unclear after a model change): ``model.to(torch.bfloat16)`` after attach made ``generate``
    raise ``InvalidRequestError: g0.l0.k: expected torch.float32``. Now the change is followed like a weights
    change: a new KV spec and layout (a new namespace, proved by the attach canary in bfloat16), tokens equal
    to plain transformers in bfloat16, and that namespace's own chunks reused from then on."""
    model = build_tiny("llama", seed=5)
    ids, _ = prompt_for(model, PROMPT, seed=3)
    with make_engine() as engine:
        am = attach(model, engine)
        am.generate(ids, max_new_tokens=1)
        old, original = am.namespace, float32_state(model)
        model.to(torch.bfloat16)
        want = reference_generate(model, ids, None, 6)
        first = am.generate(ids, max_new_tokens=6, eos_token_id=None)
        assert first.reused_tokens == 0 and list(first.new_tokens) == want
        assert am.spec.dtype == torch.bfloat16 and am.canary is not None and am.canary.passed
        assert am.namespace.kv_spec_fingerprint != old.kv_spec_fingerprint
        assert am.namespace.layout_id != old.layout_id
        again = am.generate(ids, max_new_tokens=6, eos_token_id=None)
        assert again.reused_tokens == 5 * CHUNK and list(again.new_tokens) == want
        # Back to the float32 weights: their namespace and its chunks again.
        back_to(model, original)
        back = am.generate(ids, max_new_tokens=1)
        assert am.namespace == old and back.reused_tokens == 5 * CHUNK


def test_building_blocks_after_a_dtype_change_compute_in_the_new_dtype():
    """Regression: after ``model.to(torch.bfloat16)`` the building blocks (``context``/``restore``/
    ``prefill``) raised a bare RuntimeError from a float32 cache. Now they run in bfloat16, with the logits
    of plain transformers in bfloat16."""
    model = build_tiny("llama", seed=6)
    ids, _ = prompt_for(model, PROMPT, seed=4)
    with make_engine() as engine:
        am = attach(model, engine)
        am.generate(ids, max_new_tokens=1)
        model.to(torch.bfloat16)
        ctx = am.context()
        cache, reused, ok = am.restore(ctx, ids, "r")
        logits = am.prefill(ctx, ids, cache, reused, None)
        assert ok and reused == 0 and logits.dtype == torch.bfloat16
        assert torch.equal(logits[-1].float(), plain_last_logits(model, ids))


def test_a_dtype_change_under_an_explicit_fingerprint_is_refused_naming_it():
    """Regression: under an explicit fingerprint a dtype change raised a bare RuntimeError from the building
    blocks, and from ``generate`` a message about weights only. Every public path now raises
    ModelChangedError naming the change and what to do; back to the attached weights it is served again."""
    model = build_tiny("llama", seed=7)
    ids, _ = prompt_for(model, PROMPT, seed=5)
    with make_engine() as engine:
        am = attach(model, engine, fingerprint="my-model-v1")
        am.generate(ids, max_new_tokens=1)
        original = float32_state(model)
        model.to(torch.bfloat16)
        for call in (lambda: am.generate(ids, max_new_tokens=1), am.context, lambda: am.generate(ids)):
            with pytest.raises(ModelChangedError, match="dtype changed from float32 to bfloat16.*attach it again"):
                call()
        back_to(model, original)
        assert am.generate(ids, max_new_tokens=1).reused_tokens == 5 * CHUNK


def test_a_change_the_attach_canary_refuses_is_refused_on_every_request(monkeypatch):
    """Scenario: the restore path is broken in the model's new dtype (injected layout fault). The re-run
    attach canary refuses it: every request raises AttachError and nothing is served or stored; once the
    model is back to the weights and dtype it was attached with, it is served from its original namespace."""
    model = build_tiny("llama", seed=8)
    ids, _ = prompt_for(model, PROMPT, seed=6)
    with make_engine() as engine:
        am = attach(model, engine)
        am.generate(ids, max_new_tokens=1)
        attached_ns, original = am.namespace, float32_state(model)
        monkeypatch.setattr(Restorer, "copy_attention", _token_major_copy)
        model.to(torch.bfloat16)
        stored = engine.metrics.value("kvengine_stored_chunks_total")
        for _ in range(2):
            with pytest.raises(AttachError, match="nothing will be served"):
                am.generate(ids, max_new_tokens=1)
            with pytest.raises(AttachError):
                am.context()
        assert engine.metrics.value("kvengine_stored_chunks_total") == stored + 2  # the canary's probe only
        monkeypatch.undo()
        back_to(model, original)
        out = am.generate(ids, max_new_tokens=1)
        assert am.namespace == attached_ns and out.reused_tokens == 5 * CHUNK


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to move the model to")
def test_a_device_move_re_runs_the_attach_canary_there():
    """Scenario: ``model.to("cuda")`` after attach. The same weights keep their namespace, the attach canary
    runs again on the new device (its own canary namespace), and tokens equal plain transformers there."""
    model = build_tiny("llama", seed=9)
    ids, _ = prompt_for(model, PROMPT, seed=7)
    with make_engine() as engine:
        am = attach(model, engine)
        am.generate(ids, max_new_tokens=1)
        report, namespace = am.canary, am.namespace
        model.to("cuda")
        out = am.generate(ids, max_new_tokens=6, eos_token_id=None)
        assert am.canary is not report and am.canary is not None and am.canary.passed
        assert am.namespace == namespace
        assert list(out.new_tokens) == reference_generate(model, ids, None, 6)

"""Provenance through the real HF integration: stored KV is served only to the weights that computed it.

Every scenario ends in a miss, a refusal or a quarantine, never in served KV:
weights changed after attach (in place, through ``.data``, under an explicit
fingerprint), other weights under the same name on a shared disk tier, and a
namespace whose stored KV another kernel computed (records rewritten with
valid checksums), caught by the namespace canary or by a shadow check.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from kvengine import KVEngine
from kvengine.cli.quarantine import main as quarantine_cmd
from kvengine.errors import ModelChangedError
from kvengine.integrations.hf import attach
from kvengine.trust.provenance import CanaryOutcome

from .conftest import CHUNK, build_tiny, make_engine, prompt_for, reference_generate
from .forged_records import scale_records

PROMPT = 3 * CHUNK + 5


def disk_engine(disk: Path, **extra: object) -> KVEngine:
    return KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": "64MiB"}, "write_mode": "write_through",
                     "disk": {"path": str(disk), "fsync": "never"}, **extra})


def binding_hex(am) -> str:
    return bytes(am.binding.digest).hex()


def test_weights_changed_in_place_after_attach_move_to_a_new_namespace():
    """Regression (HF, weights changed after attach): a fine-tuning-like in-place update of one projection
    made the same AttachedModel reuse 80 tokens of the old weights' KV (max logit error 1.56). Now the
    change is seen before the next request: nothing of the old namespace is reused, outputs are exact."""
    model = build_tiny("llama", seed=3)
    ids, _ = prompt_for(model, PROMPT, seed=1)
    with make_engine() as engine:
        am = attach(model, engine)
        am.generate(ids, max_new_tokens=1)
        assert am.generate(ids, max_new_tokens=1).reused_tokens == 3 * CHUNK  # control: a hit before the change
        old = am.namespace
        with torch.no_grad():
            model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
        want = reference_generate(model, ids, None, 8)
        out = am.generate(ids, max_new_tokens=8, eos_token_id=None)
        assert out.reused_tokens == 0 and list(out.new_tokens) == want
        assert am.namespace.model_fingerprint != old.model_fingerprint
        assert engine.metrics.value("kvengine_namespace_changes_total") == 1
        # The new weights' own chunks are reused from then on.
        assert am.generate(ids, max_new_tokens=8, eos_token_id=None).reused_tokens == 3 * CHUNK


def test_edits_through_data_that_bypass_version_counters_are_seen():
    """A LoRA-merge-style edit through ``.data`` (no version bump, same storage) is caught by the sampled bytes."""
    model = build_tiny("llama", seed=4)
    ids, _ = prompt_for(model, PROMPT, seed=2)
    with make_engine() as engine:
        am = attach(model, engine)
        am.generate(ids, max_new_tokens=1)
        weight = model.model.layers[0].self_attn.v_proj.weight
        version, ptr = weight._version, weight.data_ptr()
        weight.data += 0.01 * torch.randn_like(weight)  # merge a low-rank delta in place
        assert (weight._version, weight.data_ptr()) == (version, ptr)
        out = am.generate(ids, max_new_tokens=4, eos_token_id=None)
    assert out.reused_tokens == 0 and list(out.new_tokens) == reference_generate(model, ids, None, 4)


def test_a_tensor_moved_but_unchanged_keeps_its_namespace():
    """Touching the weights without changing their bytes (a copy onto itself) is no change of identity."""
    model = build_tiny("llama", seed=5)
    ids, _ = prompt_for(model, PROMPT, seed=3)
    with make_engine() as engine:
        am = attach(model, engine)
        am.generate(ids, max_new_tokens=1)
        with torch.no_grad():
            w = model.model.layers[0].mlp.up_proj.weight
            w.copy_(w.clone())
        assert am.generate(ids, max_new_tokens=1).reused_tokens == 3 * CHUNK
        assert engine.metrics.value("kvengine_namespace_changes_total") == 0


def test_a_weights_change_under_an_explicit_fingerprint_is_refused():
    """With an explicit fingerprint kvengine cannot name the new weights: the next request is refused with
    a clear error instead of serving the old weights' KV."""
    model = build_tiny("llama", seed=6)
    ids, _ = prompt_for(model, PROMPT, seed=4)
    with make_engine() as engine:
        am = attach(model, engine, fingerprint="my-model-v1")
        am.generate(ids, max_new_tokens=1)
        with torch.no_grad():
            model.lm_head.weight.add_(0.1)
        for _ in range(2):  # and again: never served by a later request either
            with pytest.raises(ModelChangedError, match="explicit fingerprint"):
                am.generate(ids, max_new_tokens=1)
        assert engine.metrics.value("kvengine_loaded_tokens_total") == 32  # the attach canary's own probe only


def test_same_architecture_other_weights_on_a_shared_disk_tier_miss(tmp_path: Path):
    """Two processes' worth of engines on one disk, one name, different weights: the second never hits."""
    ids, _ = prompt_for(build_tiny("llama", seed=7), PROMPT, seed=5)
    with disk_engine(tmp_path) as engine:
        am = attach(build_tiny("llama", seed=7), engine, model_id="team/model")
        assert am.proof.outcome is CanaryOutcome.WRITTEN
        am.generate(ids, max_new_tokens=1)
    other = build_tiny("llama", seed=8)
    with disk_engine(tmp_path) as engine:
        am = attach(other, engine, model_id="team/model")
        out = am.generate(ids, max_new_tokens=6, eos_token_id=None)
        assert am.proof.outcome is CanaryOutcome.WRITTEN  # its own namespace: no canary there yet
    assert out.reused_tokens == 0 and list(out.new_tokens) == reference_generate(other, ids, None, 6)


def test_kv_written_by_another_kernel_is_caught_by_the_namespace_canary(tmp_path: Path, capsys):
    """Same weights, but the stored KV (chunks and canary) was computed differently (simulated: every
    record rewritten, checksums valid). The reader's canary finds it before serving: the namespace is
    quarantined, nothing of it is served or stored, the operator command lists and purges it."""
    model = build_tiny("llama", seed=9)
    ids, _ = prompt_for(model, PROMPT, seed=6)
    with disk_engine(tmp_path) as engine:
        writer = attach(model, engine)
        writer.generate(ids, max_new_tokens=1)
        chunks = binding_hex(writer)
    # three chunks, the namespace canary, and the attach canary's two probe chunks (a root of their own)
    assert scale_records(tmp_path) == 3 + 1 + 2
    with disk_engine(tmp_path) as engine:
        am = attach(model, engine)
        assert am.proof.outcome is CanaryOutcome.MISMATCH
        assert engine.is_quarantined(am.binding)
        m = engine.metrics
        loaded_before = m.value("kvengine_loaded_tokens_total")  # the attach canary's own probe
        out = am.generate(ids, max_new_tokens=6, eos_token_id=None)
        assert m.value("kvengine_provenance_checks_total", check="canary", outcome="mismatch") == 1
        assert m.value("kvengine_quarantined_namespaces") == 1
        assert m.value("kvengine_quarantine_refusals_total", op="lookup") >= 1
        assert m.value("kvengine_quarantine_refusals_total", op="store") >= 1
        assert m.value("kvengine_loaded_tokens_total") == loaded_before
    assert out.reused_tokens == 0 and list(out.new_tokens) == reference_generate(model, ids, None, 6)
    # A restart on the same disk still refuses it (the quarantine is persisted).
    with disk_engine(tmp_path) as engine:
        am = attach(model, engine)
        assert am.proof.outcome is CanaryOutcome.QUARANTINED
        assert am.generate(ids, max_new_tokens=1).reused_tokens == 0
    assert quarantine_cmd(["list", "--disk", str(tmp_path)]) == 0
    listed = capsys.readouterr().out
    root = am.binding.root
    assert root in listed and "namespace canary differs" in listed and "4 records under 2 namespaces" in listed
    assert quarantine_cmd(["purge", "--disk", str(tmp_path), root]) == 0
    assert "4 records deleted" in capsys.readouterr().out
    assert not list(tmp_path.glob(f"{chunks}*.kvc"))
    # After the purge a fresh engine writes a new canary and caches again.
    with disk_engine(tmp_path) as engine:
        am = attach(model, engine)
        assert am.proof.outcome is CanaryOutcome.WRITTEN
        am.generate(ids, max_new_tokens=1)
        assert am.generate(ids, max_new_tokens=1).reused_tokens == 3 * CHUNK


def test_a_shadow_check_catches_chunks_that_the_canary_cannot_see(tmp_path: Path):
    """Only the chunks were computed differently (the canary is intact, so it passes): the first hit is
    shadow-checked (recomputed, compared, not loaded), the mismatch quarantines the namespace, and no
    later request is served from it."""
    model = build_tiny("llama", seed=10)
    ids, _ = prompt_for(model, PROMPT, seed=7)
    with disk_engine(tmp_path) as engine:
        writer = attach(model, engine)
        writer.generate(ids, max_new_tokens=1)
        canary_prefix = tuple(n.name[:32] for n in tmp_path.glob("*.kvc") if not n.name.startswith(binding_hex(writer)))
    assert scale_records(tmp_path, skip=canary_prefix) == 3  # the chunks only
    want = reference_generate(model, ids, None, 6)
    with disk_engine(tmp_path, shadow={"first_hits": 1}) as engine:
        am = attach(model, engine)
        assert am.proof.outcome is CanaryOutcome.EXACT
        first = am.generate(ids, max_new_tokens=6, eos_token_id=None)
        assert first.shadow == "mismatch" and first.reused_tokens == 0 and list(first.new_tokens) == want
        assert engine.is_quarantined(am.binding)
        later = am.generate(ids, max_new_tokens=6, eos_token_id=None)
        assert later.reused_tokens == 0 and later.shadow is None and list(later.new_tokens) == want
        assert engine.metrics.value("kvengine_provenance_checks_total", check="shadow", outcome="mismatch") == 1


def test_a_shadow_check_of_honest_kv_passes_and_later_hits_are_served(tmp_path: Path):
    """Control: the same shadow check on KV this model wrote is exact, and the next hit is loaded."""
    model = build_tiny("llama", seed=11)
    ids, _ = prompt_for(model, PROMPT, seed=8)
    with disk_engine(tmp_path) as engine:
        attach(model, engine).generate(ids, max_new_tokens=1)
    with disk_engine(tmp_path, shadow={"first_hits": 1}) as engine:
        am = attach(model, engine)
        first = am.generate(ids, max_new_tokens=1)
        second = am.generate(ids, max_new_tokens=1)
        assert engine.metrics.value("kvengine_provenance_checks_total", check="shadow", outcome="exact") == 1
    assert first.shadow == "exact" and first.reused_tokens == 0
    assert second.shadow is None and second.reused_tokens == 3 * CHUNK

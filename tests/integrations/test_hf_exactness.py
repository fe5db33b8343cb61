"""Exactness matrix: kvengine's cached continuation equals transformers' own, per family (fp32).

For every family of :data:`TINY_CONFIGS` (GQA, MHA, sliding window, sliding +
global, MLA, interleaved and parallel hybrids, Mamba2, encoder-decoder):

* the cache restored from the engine is bitwise identical to the in-memory
  cache it was stored from (the strict oracle: serialisation must be lossless);
* logits of the suffix continued over the restored cache are within 1e-5 of
  a single full prefill;
* 20 greedy tokens from a cache hit equal plain ``model.generate``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kvengine.integrations.hf import attach
from kvengine.integrations.hf.tiny_models import TINY_CONFIGS

from .conftest import (
    CHUNK,
    FAST_FAMILIES,
    SLOW_FAMILIES,
    build_tiny,
    family_params,
    make_engine,
    prompt_for,
    reference_generate,
)

PREFIX = 3 * CHUNK  # past every window of the tiny configs (12)
TOTAL = PREFIX + 9


def test_matrix_covers_every_tiny_family():
    """The fast and slow families together cover every tiny model family exactly once."""
    assert sorted(FAST_FAMILIES + SLOW_FAMILIES) == sorted(TINY_CONFIGS)


@pytest.fixture(scope="module", params=family_params())
def attached(request):
    model = build_tiny(request.param)
    engine = make_engine()
    yield attach(model, engine, model_id=f"tiny-{request.param}")
    engine.close()


def test_restored_cache_is_bitwise_identical_to_the_in_memory_cache(attached):
    """Scenario: store a prefix from a live cache, load it into a fresh one; every tensor and length is equal."""
    ids, enc = prompt_for(attached.model, TOTAL, seed=1)
    ctx = attached.context(enc)
    in_memory = attached.codec.new_cache()
    attached.codec.record(in_memory)
    snapshots: dict = {}
    attached.prefill(ctx, ids[:PREFIX], in_memory, 0, snapshots)
    assert attached.store(ctx, ids[:PREFIX], in_memory, snapshots) == PREFIX // CHUNK

    restored, matched, ok = attached.restore(ctx, ids, "exact-restore")
    assert ok and matched == PREFIX
    want, got = attached.codec.comparable(in_memory), attached.codec.comparable(restored)
    assert want.keys() == got.keys()
    for key in want:
        for w, g in zip(want[key], got[key], strict=True):
            assert w.dtype == g.dtype and w.shape == g.shape, key
            assert torch.equal(w, g), f"{key} differs"


def test_cached_continuation_matches_full_prefill_logits(attached):
    """Scenario: suffix over a restored prefix vs one full prefill: max abs logit diff <= 1e-5."""
    ids, enc = prompt_for(attached.model, TOTAL, seed=2)
    ctx = attached.context(enc)
    full = attached.runner.forward(ids, attached.codec.new_cache(), 0, encoder_outputs=ctx.encoder_outputs,
                                   all_logits=True)
    first = attached.codec.new_cache()
    attached.codec.record(first)
    snapshots: dict = {}
    attached.prefill(ctx, ids, first, 0, snapshots)
    attached.store(ctx, ids, first, snapshots)

    restored, matched, _ = attached.restore(ctx, ids, "exact-logits")
    assert matched == PREFIX  # (TOTAL - 1) // CHUNK chunks
    cont = attached.prefill(ctx, ids, restored, matched, None, all_logits=True)
    diff = (cont - full[matched:]).abs().max().item()
    assert diff <= 1e-5, f"max abs logit diff {diff}"


def test_twenty_greedy_tokens_from_a_cache_hit_equal_plain_generate(attached):
    """Scenario: a miss stores the prompt; the same prompt again hits and yields the same 20 greedy tokens."""
    ids, enc = prompt_for(attached.model, TOTAL + 3, seed=3)
    want = reference_generate(attached.model, ids, enc, 20)
    miss = attached.generate(ids, encoder_input_ids=enc, max_new_tokens=20, eos_token_id=None)
    hit = attached.generate(ids, encoder_input_ids=enc, max_new_tokens=20, eos_token_id=None)
    assert miss.reused_tokens == 0 and hit.reused_tokens == PREFIX
    assert list(miss.new_tokens) == want
    assert list(hit.new_tokens) == want


def test_multi_turn_reuses_generated_tokens(attached):
    """Scenario: turn 2's prompt extends turn 1's prompt + answer; chunks completed while decoding are reused."""
    ids, enc = prompt_for(attached.model, CHUNK + 5, seed=4)
    turn1 = attached.generate(ids, encoder_input_ids=enc, max_new_tokens=2 * CHUNK, eos_token_id=None)
    history = torch.cat([ids, torch.tensor(turn1.new_tokens), torch.randint(4, 256, (7,))])
    want = reference_generate(attached.model, history, enc, 8)
    turn2 = attached.generate(history, encoder_input_ids=enc, max_new_tokens=8, eos_token_id=None)
    assert turn2.reused_tokens == (len(ids) + 2 * CHUNK - 1) // CHUNK * CHUNK
    assert list(turn2.new_tokens) == want


@pytest.mark.parametrize("family", ["llama", "mistral", "mamba2"])
def test_sampling_is_reproducible_with_and_without_cache(family):
    """Scenario: seeded temperature sampling gives the same tokens on a miss and on a hit."""
    from kvengine.integrations.hf import Sampling

    model = build_tiny(family)
    with make_engine() as engine:
        am = attach(model, engine)
        ids, _ = prompt_for(model, 40, seed=5)
        s = Sampling(temperature=0.8, top_k=20, seed=7)
        a = am.generate(ids, max_new_tokens=12, sampling=s, use_cache=False, store=True, eos_token_id=None)
        b = am.generate(ids, max_new_tokens=12, sampling=s, eos_token_id=None)
        assert b.reused_tokens == 32
        assert a.new_tokens == b.new_tokens

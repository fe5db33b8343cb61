"""kvengine.lookups: one type for every answer a lookup can give, from the engine to a scheduler."""

from __future__ import annotations

import pickle

import pytest

from kvengine.chunks.keys import Namespace
from kvengine.errors import InvalidRequestError
from kvengine.facade import KVEngine
from kvengine.lookups import MISS, PENDING, TIMED_OUT, LookupOutcome, LookupResult

from .conftest import CHUNK, FakeKV, make_layout


def test_the_engines_answer_is_a_hit_or_a_miss_with_its_reservation():
    """The engine's lookup answers in the one lookup type: a miss too carries its (empty) reservation, which
    the caller ends like a hit's, so asking again counts nothing twice; the wire form drops the reservation,
    and the engine refuses to load or release a result that has none."""
    layout = make_layout()
    tokens = list(range(2 * CHUNK + 3))
    with KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": "1MiB"}}, transports=[]) as eng:
        binding = eng.bind(Namespace(model="lookups"), layout)
        miss = eng.lookup(binding, "cold", tokens)
        assert miss == MISS and miss.reservation is not None and miss.reservation.matched_tokens == 0
        assert eng.metrics.value("kvengine_reservations_active") == 1
        eng.release(miss)
        assert eng.metrics.value("kvengine_reservations_active") == 0
        eng.store(binding, tokens, FakeKV(len(tokens)).source)
        hit = eng.lookup(binding, "warm", tokens)
        assert (hit.outcome, hit.tokens, hit.loadable) == (LookupOutcome.HIT, 2 * CHUNK, 2 * CHUNK)
        assert hit.reservation is not None and hit.reservation.matched_tokens == 2 * CHUNK
        assert eng.pinned_chunks() == 2
        sent = pickle.loads(pickle.dumps(hit))  # what crosses to another process (the vLLM channel)
        assert sent == hit and sent.reservation is None  # the reservation stays with the engine that pins it
        for call in (lambda: eng.release(sent), lambda: eng.load(sent, lambda view: None)):
            with pytest.raises(InvalidRequestError, match="a hit lookup result without a reservation"):
                call()
        eng.release(hit)
        assert eng.pinned_chunks() == 0


def test_only_a_hit_is_loadable():
    assert LookupResult(LookupOutcome.SHADOWED, 32).loadable == 0  # recomputed and compared, never loaded
    for answer in (MISS, PENDING, TIMED_OUT, LookupResult(LookupOutcome.FAILED, error="boom")):
        assert answer.loadable == 0 and answer.tokens == 0


@pytest.mark.parametrize("outcome, tokens", [(LookupOutcome.HIT, 0), (LookupOutcome.SHADOWED, 0),
                                             (LookupOutcome.MISS, 16), (LookupOutcome.PENDING, 1),
                                             (LookupOutcome.HIT, -16)])
def test_tokens_go_with_a_hit_or_a_shadow_check_only(outcome, tokens):
    with pytest.raises(ValueError, match=f"a {outcome.value} lookup with {tokens} tokens"):
        LookupResult(outcome, tokens)

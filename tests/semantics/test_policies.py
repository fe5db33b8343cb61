"""The KV semantics registry: every category has a policy that says what, when and why."""

from __future__ import annotations

import pytest

from kvengine import KVCategory, UnsupportedModelError
from kvengine.semantics import POLICIES, MatchRule, Storage, policy_for

MODEL_CATEGORIES = [c for c in KVCategory if c is not KVCategory.OPAQUE]


@pytest.mark.parametrize("category", MODEL_CATEGORIES, ids=lambda c: c.name)
def test_every_model_category_has_a_policy_stating_what_when_why(category):
    """Each category states what is stored, when a prefix match is valid, and why."""
    p = policy_for(category)
    assert p.category is category
    assert p.stores and p.valid_when and p.why


def test_opaque_bytes_have_no_model_policy():
    """OPAQUE is engine-level bytes; deriving a model layer from it must fail, not default."""
    with pytest.raises(UnsupportedModelError, match="OPAQUE"):
        policy_for(KVCategory.OPAQUE)


def test_state_matches_only_at_snapshot_boundaries():
    """Recurrent state cannot be cropped: a match must end at a snapshot boundary."""
    p = POLICIES[KVCategory.LINEAR_STATE]
    assert p.match is MatchRule.SNAPSHOT_BOUNDARY and p.storage is Storage.PER_BOUNDARY


def test_cross_attention_is_keyed_by_the_encoder_input():
    """Cross-attention reuse is valid only under the same encoder input, never by decoder prefix alone."""
    p = POLICIES[KVCategory.CROSS_ATTENTION]
    assert p.match is MatchRule.SAME_ENCODER_INPUT
    assert "encoder input" in p.valid_when


@pytest.mark.parametrize("category", [KVCategory.SLIDING_WINDOW, KVCategory.CHUNKED_LOCAL])
def test_windowed_policies_require_length_bookkeeping(category):
    """Sliding/chunked restores must set the cache's cumulative length, not just tensors."""
    p = POLICIES[category]
    assert p.needs_bookkeeping and "cumulative" in p.stores + p.valid_when


def test_encoder_only_stores_nothing():
    """Encoder-only models store nothing and never match."""
    p = POLICIES[KVCategory.ENCODER_ONLY]
    assert p.storage is Storage.NOTHING and p.match is MatchRule.NEVER

"""The KV semantics registry: one reuse policy per cache category.

A policy states, for one kind of per-layer cache state, what kvengine
stores per chunk, when a cached prefix may be reused, and why. Every layer
group of a :class:`~kvengine.semantics.spec.ModelKVSpec` points at exactly one
policy; a category without a policy cannot be derived at all, so there is no
"store it anyway" path.

Primitives:

* :data:`POLICIES` - ``KVCategory -> ReusePolicy``.
* :func:`policy_for` - the policy of a category (raises for unknown ones).
* :class:`MatchRule` - where a prefix match may end.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvengine.chunks.layout import KVCategory
from kvengine.errors import UnsupportedModelError


class MatchRule(enum.Enum):
    """Where a reused prefix may end."""

    #: Any chunk boundary: per-token K/V of the prefix is all the model needs.
    ANY_CHUNK_BOUNDARY = "any chunk boundary"
    #: Only a boundary with a state snapshot taken exactly there.
    SNAPSHOT_BOUNDARY = "snapshot boundary only"
    #: Only under the same encoder input (namespace keyed by its digest).
    SAME_ENCODER_INPUT = "same encoder input"
    #: Nothing is reusable.
    NEVER = "never"


class Storage(enum.Enum):
    """How a category's bytes grow."""

    PER_TOKEN = "per token"
    PER_BOUNDARY = "per chunk boundary"
    PER_ENCODER_TOKEN = "per encoder token"
    NOTHING = "nothing"


@dataclass(frozen=True, slots=True, kw_only=True)
class ReusePolicy:
    """What is stored for a category, when a prefix match is valid, and why."""

    category: KVCategory
    short: str
    storage: Storage
    match: MatchRule
    stores: str
    valid_when: str
    why: str
    #: True when a restore must set cache bookkeeping beyond the tensors.
    needs_bookkeeping: bool = False

    def __post_init__(self) -> None:
        if not (self.stores and self.valid_when and self.why):
            raise ValueError(f"policy for {self.category.name} must state what, when and why")


_POLICY_LIST = (
    ReusePolicy(
        category=KVCategory.FULL_ATTENTION,
        short="full",
        storage=Storage.PER_TOKEN,
        match=MatchRule.ANY_CHUNK_BOUNDARY,
        stores="per-token K and V of every layer in the group ([kv_heads, tokens, head_dim]; MHA, GQA and MQA differ "
        "only in kv_heads)",
        valid_when="the request's tokens equal the cached prefix chunk by chunk, under the same namespace "
        "(model weights, KV spec, layout, adapter, salt)",
        why="causal attention: the K/V of token t depend only on tokens <= t, so the prefix KV of a longer request "
        "is the KV the model would compute itself",
    ),
    ReusePolicy(
        category=KVCategory.MLA_LATENT,
        short="mla",
        storage=Storage.PER_TOKEN,
        match=MatchRule.ANY_CHUNK_BOUNDARY,
        stores="the compressed latent (normed c_kv, [1, tokens, kv_lora_rank]) as 'keys' and the RoPE'd shared key "
        "([1, tokens, qk_rope_head_dim]) as 'values'; K and V have different widths",
        valid_when="as full attention",
        why="the latent is a per-token function of the causal prefix, exactly like K/V; the up-projections are "
        "weights and are re-applied at attention time",
    ),
    ReusePolicy(
        category=KVCategory.SLIDING_WINDOW,
        short="sliding",
        storage=Storage.PER_TOKEN,
        match=MatchRule.ANY_CHUNK_BOUNDARY,
        stores="per-token K and V of every chunk (any chunk may end a future match); a restore keeps only the "
        "last window-1 tokens and sets the layer's cumulative length to the full prefix length",
        valid_when="as full attention; the cache's length bookkeeping (cumulative_length) must equal the prefix "
        "length, not the number of tokens held",
        why="a windowed layer attends to at most window-1 earlier tokens, whose K/V depend only on the causal "
        "prefix; the mask offset is derived from cumulative_length, so a wrong length shifts the window",
        needs_bookkeeping=True,
    ),
    ReusePolicy(
        category=KVCategory.CHUNKED_LOCAL,
        short="chunked",
        storage=Storage.PER_TOKEN,
        match=MatchRule.ANY_CHUNK_BOUNDARY,
        stores="per-token K and V; a restore keeps the last attention_chunk_size-1 tokens and the cumulative length "
        "(the cache holds it like a sliding window, only the mask differs)",
        valid_when="as sliding window",
        why="attention is restricted to the current attention chunk; the held tokens and the length bookkeeping "
        "determine the mask exactly as for a sliding window",
        needs_bookkeeping=True,
    ),
    ReusePolicy(
        category=KVCategory.ATTENTION_SINK,
        short="sink",
        storage=Storage.PER_TOKEN,
        match=MatchRule.ANY_CHUNK_BOUNDARY,
        stores="per-token K and V as for full attention; learned per-head sink logits (gpt-oss) are weights, "
        "covered by the model fingerprint",
        valid_when="as full attention. StreamingLLM-style caches that evict middle tokens and keep sink tokens are "
        "refused: the kept tokens' positions depend on the cache's history, not on the prefix",
        why="a learned sink adds a constant logit per head; it does not change what a token's K/V are",
    ),
    ReusePolicy(
        category=KVCategory.LINEAR_STATE,
        short="state",
        storage=Storage.PER_BOUNDARY,
        match=MatchRule.SNAPSHOT_BOUNDARY,
        stores="a snapshot of the recurrent (SSM / linear-attention) state and the short-conv window, taken exactly "
        "at each chunk's end boundary while prefilling in chunk-sized pieces",
        valid_when="the match ends exactly at a boundary that has a snapshot; only the last matched chunk's snapshot "
        "is restored",
        why="the state summarises the whole prefix and cannot be cropped or shifted: a snapshot from position 64 "
        "used at 48 is garbage (max logit error ~5), one taken exactly at the boundary is exact to ~1e-5",
    ),
    ReusePolicy(
        category=KVCategory.CROSS_ATTENTION,
        short="cross",
        storage=Storage.PER_ENCODER_TOKEN,
        match=MatchRule.SAME_ENCODER_INPUT,
        stores="nothing per decoder token; decoder self-attention chunks live in a namespace keyed by the digest of "
        "the whole encoder input, and cross-attention K/V are recomputed from that encoder input",
        valid_when="the encoder input is identical token for token, and then the decoder prefix matches",
        why="a bidirectional encoder makes every cross-attention K/V depend on the whole encoder input; a shared "
        "decoder prefix (or a shared encoder prefix) alone says nothing about them",
    ),
    ReusePolicy(
        category=KVCategory.ENCODER_ONLY,
        short="none",
        storage=Storage.NOTHING,
        match=MatchRule.NEVER,
        stores="nothing",
        valid_when="never",
        why="an encoder-only model keeps no cache between forward passes; there is nothing to reuse",
    ),
)

POLICIES: dict[KVCategory, ReusePolicy] = {p.category: p for p in _POLICY_LIST}


def policy_for(category: KVCategory) -> ReusePolicy:
    """The reuse policy of ``category``; :class:`UnsupportedModelError` if there is none."""
    try:
        return POLICIES[category]
    except KeyError:
        raise UnsupportedModelError(f"no reuse policy for KV category {category.name}") from None

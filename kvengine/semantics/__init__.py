"""KV semantics: what each kind of cache state is, when it may be reused, and a model's spec.

* :mod:`.policies` - the registry: one :class:`ReusePolicy` per :class:`~kvengine.chunks.layout.KVCategory`.
* :mod:`.spec` - :class:`ModelKVSpec` (layer groups, sizes, chunk layout, fingerprint).
* :mod:`.families` - derivation from a transformers config (allowlist; unknown -> refused).
* :mod:`.canary` - the attach-time check comparing a cached continuation with a plain prefill.
"""

from __future__ import annotations

from .canary import EXACT, CanaryReport, CanaryTolerance, GroupMismatch, compare_states
from .families import (
    REFUSED_FAMILIES,
    ModelConfigError,
    derive_spec,
    known_model_types,
    load_model_config,
    refusal_reasons,
)
from .policies import POLICIES, MatchRule, ReusePolicy, Storage, policy_for
from .spec import AttentionPart, LayerGroup, LayerSpec, ModelKVSpec, StatePart

__all__ = [
    "EXACT", "POLICIES", "REFUSED_FAMILIES", "AttentionPart", "CanaryReport", "CanaryTolerance", "GroupMismatch",
    "LayerGroup", "LayerSpec", "MatchRule", "ModelConfigError", "ModelKVSpec", "ReusePolicy", "StatePart", "Storage",
    "compare_states", "derive_spec", "known_model_types", "load_model_config", "policy_for", "refusal_reasons",
]

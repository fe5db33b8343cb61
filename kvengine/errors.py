"""Exception hierarchy.

Caller mistakes (bad configuration, malformed input) raise. Cache faults
(corrupt bytes, unreachable tiers, exhausted capacity while serving) never
raise into an inference engine: the engine turns them into counted misses.
"""

from __future__ import annotations

from typing import Literal, get_args


class KVEngineError(Exception):
    """Base class of every error raised by kvengine."""


class ConfigError(KVEngineError, ValueError):
    """A configuration key is unknown or its value is invalid."""


class InvalidRequestError(KVEngineError, ValueError):
    """A caller passed tokens or tensors that cannot be cached as given."""


#: What :class:`EngineClosedError` says, from the facade and the asyncio core alike.
CLOSED_MESSAGE = "kvengine: the engine is closed; calls after close() are refused"


class EngineClosedError(KVEngineError, RuntimeError):
    """A call reached an engine after its ``close()``, or was still waiting on the facade's loop when
    ``close()`` stopped it. A ``RuntimeError`` too, which a closed event loop raised before."""


class CapacityError(KVEngineError):
    """An object can never fit the configured capacity of a tier."""


#: Why stored bytes were refused: a closed set, because each is a metric label
#: (``kvengine_integrity_failures{tier,reason}``) and a dashboard must know them all.
IntegrityReason = Literal[
    "bad_descriptor",
    "bad_mac",
    "bad_magic",
    "codec_checksum",
    "codec_decode",
    "codec_layout",
    "codec_length",
    "codec_mismatch",
    "codec_truncated",
    "codec_version",
    "damaged_version",
    "decode_error",
    "header_checksum",
    "layout_mismatch",
    "other_key",
    "other_namespace",
    "other_version",
    "oversized",
    "payload_checksum",
    "too_many_dims",
    "trailing_bytes",
    "truncated_header",
    "truncated_payload",
    "unauthenticated",
    "unknown_codec",
    "verification_flag",
    "wrong_length",
    "wrong_position",
]
INTEGRITY_REASONS: frozenset[str] = frozenset(get_args(IntegrityReason))


class IntegrityError(KVEngineError):
    """Stored bytes failed verification (header, length, checksum, namespace)."""

    def __init__(self, reason: IntegrityReason, detail: str = "") -> None:
        if reason not in INTEGRITY_REASONS:
            raise ValueError(f"unknown integrity reason {reason!r} (add it to IntegrityReason)")
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason: IntegrityReason = reason


class TransportError(KVEngineError):
    """A storage or network transport failed to complete an operation."""


class UnsupportedModelError(KVEngineError):
    """A model, layer type or layout that kvengine cannot reuse correctly."""


class AttachError(KVEngineError):
    """Attach-time verification failed; nothing will be served for this model."""


class ModelChangedError(InvalidRequestError):
    """An attached model's weights changed under an explicit fingerprint: kvengine cannot name the new
    weights, and serving KV of the old ones would be wrong. Give the new weights a new fingerprint."""

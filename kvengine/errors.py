"""Exception hierarchy.

Caller mistakes (bad configuration, malformed input) raise. Cache faults
(corrupt bytes, unreachable tiers, exhausted capacity while serving) never
raise into an inference engine: the engine turns them into counted misses.
"""

from __future__ import annotations


class KVEngineError(Exception):
    """Base class of every error raised by kvengine."""


class ConfigError(KVEngineError, ValueError):
    """A configuration key is unknown or its value is invalid."""


class InvalidRequestError(KVEngineError, ValueError):
    """A caller passed tokens or tensors that cannot be cached as given."""


class CapacityError(KVEngineError):
    """An object can never fit the configured capacity of a tier."""


class IntegrityError(KVEngineError):
    """Stored bytes failed verification (header, length, checksum, namespace)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class TransportError(KVEngineError):
    """A storage or network transport failed to complete an operation."""


class UnsupportedModelError(KVEngineError):
    """A model, layer type or layout that kvengine cannot reuse correctly."""


class AttachError(KVEngineError):
    """Attach-time verification failed; nothing will be served for this model."""


class ModelChangedError(InvalidRequestError):
    """An attached model's weights changed under an explicit fingerprint: kvengine cannot name the new
    weights, and serving KV of the old ones would be wrong. Give the new weights a new fingerprint."""

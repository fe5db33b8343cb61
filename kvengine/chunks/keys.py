"""Typed cache keys and the namespace that seeds every prefix hash chain.

A chunk is addressed by ``ChunkKey(namespace, chunk_hash)``. The chunk hash
already depends on the namespace (the chain is seeded with it), the namespace
is kept alongside so that tiers can ignore foreign chunks without reading
their payload.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, NewType

import xxhash

from kvengine.errors import InvalidRequestError

#: 16-byte xxh3-128 digest of one chunk and every token before it.
ChunkHash = NewType("ChunkHash", bytes)
#: 16-byte xxh3-128 digest of a :class:`Namespace`.
NamespaceDigest = NewType("NamespaceDigest", bytes)

DIGEST_BYTES = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class Namespace:
    """Everything that changes the bytes or the meaning of cached KV.

    Two requests whose namespaces differ in any field never share a chunk.
    ``verified`` is False only for chunks written under an explicit debug
    override of attach-time verification; such chunks live in their own
    namespace and are never served to a normal reader.
    """

    model: str
    model_fingerprint: str = ""
    kv_spec_fingerprint: str = ""
    layout_id: str = ""
    rank: int = 0
    world_size: int = 1
    cache_salt: str = ""
    adapter_id: str = ""
    codec_family: str = "lossless"
    extra_keys: tuple[str, ...] = field(default_factory=tuple)
    verified: bool = True

    def __post_init__(self) -> None:
        if not self.model:
            raise InvalidRequestError("Namespace.model must be a non-empty model identity")
        if not 0 <= self.rank < self.world_size:
            raise InvalidRequestError(
                f"Namespace.rank={self.rank} must be in [0, world_size={self.world_size})"
            )
        if not all(isinstance(k, str) for k in self.extra_keys):
            raise InvalidRequestError("Namespace.extra_keys must be a tuple of strings")

    def digest(self) -> NamespaceDigest:
        """Stable across processes and machines (canonical JSON, xxh3-128)."""
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return NamespaceDigest(xxhash.xxh3_128_digest(b"kvengine-ns-v1\0" + canonical.encode()))

    def with_updates(self, **changes: Any) -> Namespace:
        fields: dict[str, Any] = asdict(self)
        fields.update(changes)
        fields["extra_keys"] = tuple(fields["extra_keys"])
        return Namespace(**fields)


@dataclass(frozen=True, slots=True)
class ChunkKey:
    """Address of one stored chunk."""

    namespace: NamespaceDigest
    chunk_hash: ChunkHash

    def __post_init__(self) -> None:
        if len(self.namespace) != DIGEST_BYTES or len(self.chunk_hash) != DIGEST_BYTES:
            raise InvalidRequestError("ChunkKey parts must be 16-byte digests")

    def __hash__(self) -> int:
        # The chunk hash alone: it is uniform already (and chained from the namespace), and a bytes
        # object caches its own hash, so a key is hashed once instead of hashing a tuple at every lookup.
        return hash(self.chunk_hash)

    def hex(self) -> str:
        """Filesystem- and wire-safe name, unique per key."""
        return self.namespace.hex() + self.chunk_hash.hex()

    @classmethod
    def from_hex(cls, text: str) -> ChunkKey:
        raw = bytes.fromhex(text)
        if len(raw) != 2 * DIGEST_BYTES:
            raise InvalidRequestError(f"not a chunk key: {text!r}")
        return cls(NamespaceDigest(raw[:DIGEST_BYTES]), ChunkHash(raw[DIGEST_BYTES:]))

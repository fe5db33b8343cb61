"""The tiers below memory, as one engine sees them: each transport with the codec it is written with.

Shared by the engine's promotion (reads) and its tier writer (writes), and
by extensions of the engine (:mod:`.keyed`). Its contract: a tier call that
fails is a counted fault (``kvengine_tier_errors_total{tier,op}``) answered
with a default, never an exception to the caller (:meth:`TierSet.guarded`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import TypeVar

from kvengine.chunks.codecs import Codec, CodecRegistry
from kvengine.chunks.keys import Namespace
from kvengine.compression import codec_family
from kvengine.errors import ConfigError, InvalidRequestError
from kvengine.metrics import EngineMetrics
from kvengine.tiers import Tier
from kvengine.transport import ChunkTransport, capabilities_of, writes_gathered

T_ = TypeVar("T_")


def resolve_codec(codecs: CodecRegistry, name: str, setting: str) -> Codec:
    """The codec called ``name``; a :class:`ConfigError` naming ``setting`` if there is none."""
    try:
        return codecs.by_name(name)
    except ValueError as exc:
        raise ConfigError(f"{setting}: {exc}") from None


class TierSet:
    """Lower tiers in lookup order; a bare transport is written with ``default_codec``."""

    def __init__(self, tiers: Sequence[ChunkTransport | Tier], codecs: CodecRegistry, *, default_codec: str,
                 metrics: EngineMetrics) -> None:
        self.metrics = metrics
        pairs = [(t.transport, resolve_codec(codecs, t.codec, t.setting)) if isinstance(t, Tier)
                 else (t, resolve_codec(codecs, default_codec, "disk.codec")) for t in tiers]
        self.transports: tuple[ChunkTransport, ...] = tuple(t for t, _ in pairs)
        families = {codec_family(c) for _, c in pairs}
        if len(families) > 1:
            # One namespace is served by every tier, so the tiers must decode to the same KV.
            raise ConfigError(
                "the lower tiers' codecs decode to different KV (families "
                f"{sorted(families)}); use one lossy codec everywhere or lossless codecs only"
            )
        #: What every lower tier's records decode to (None: no lower tiers).
        self.family = families.pop() if families else None
        #: The codec every lower tier writes with when that family is lossy (one lossy codec per family);
        #: None when the tiers are lossless or absent.
        self.lossy_codec: Codec | None = next((c for _, c in pairs if not c.lossless), None)
        self._names = sorted({c.name for _, c in pairs})
        self._described = ", ".join(f"{t.name} ({c.name})" for t, c in pairs) or "none"
        #: codec -> its tiers, each with whether it takes records as parts (:class:`WritesGathered`);
        #: a record is encoded once per codec, not once per tier.
        self.by_codec: dict[Codec, list[tuple[ChunkTransport, bool]]] = {}
        for transport, codec in pairs:
            capabilities_of(transport)  # a capability declared wrongly refuses the start, naming the transport
            self.by_codec.setdefault(codec, []).append((transport, writes_gathered(transport)))
        metrics.watch_tiers(self.transports)

    def __bool__(self) -> bool:
        return bool(self.transports)

    def describe(self) -> str:
        """The tiers in lookup order with their codecs, e.g. ``local_disk (raw), peers_zmq (raw)``."""
        return self._described

    def check_namespace(self, namespace: Namespace) -> None:
        """Refuse a namespace that asks for other KV than the tiers' codecs give (a lossy tier must
        never answer a reader that asked for exact KV)."""
        if self.family is not None and namespace.codec_family != self.family:
            raise InvalidRequestError(
                f"the lower tiers store chunks with codec {', '.join(self._names)} (family {self.family!r}) "
                f"but the namespace asks for codec_family={namespace.codec_family!r}; bind with "
                f"Namespace(..., codec_family={self.family!r}) or configure lossless tier codecs"
            )

    def fault(self, transport: ChunkTransport, op: str, exc: BaseException) -> None:
        """Count a tier's failed call (a miss or a lost write for the caller, never an exception)."""
        self.metrics.tier_errors.labels(tier=transport.name, op=op).inc()
        self.metrics.log_once(f"tier:{transport.name}:{op}", "kvengine: tier %s failed a %s (%s: %s); served as a "
                              "miss", transport.name, op, type(exc).__name__, exc)

    async def guarded(self, transport: ChunkTransport, op: str, call: Awaitable[T_], default: T_) -> T_:
        """Await a tier call; a failure is counted (:meth:`fault`) and answered with ``default``."""
        try:
            return await call
        except Exception as exc:
            self.fault(transport, op, exc)
            return default

    async def close(self) -> None:
        for transport in self.transports:
            await transport.close()

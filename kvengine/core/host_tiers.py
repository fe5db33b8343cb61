"""The lower tiers of ``kvengine host``: disk, peers and Mooncake below the shared arena, owned by the service.

Engines attached to the service then configure no tier of their own. Each
chunk a client commits to the arena is handed here to a write-behind
:class:`~kvengine.core.tier_writer.TierWriter`; a client whose lookup finds
fewer chunks resident than it asked for asks the service to promote the rest
(:attr:`kvengine.host.wire.Op.PROMOTE`), and a
:class:`~kvengine.core.promotion.Promoter` reads, verifies and admits them
into that client's pool exactly as an engine does in-process: same record
checks, same positions, same single flight per chunk. A restarted service
therefore serves, from its first lookup on, everything its disk tier holds.

Each pool (tenant quota, or the shared rest) has its own promoter and writer
over its own memory tier; the tiers below are one set for all. All of it runs
on one event loop in a thread of its own; the service's connection threads
submit to it and wait.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvengine.buffers import BufferPool
from kvengine.chunks.keys import ChunkKey, Namespace, NamespaceDigest
from kvengine.chunks.layout import ChunkLayout
from kvengine.compression import default_codecs
from kvengine.config import EngineConfig
from kvengine.core.memory_tier import MemoryTier
from kvengine.core.pins import Pins, release_all
from kvengine.core.promotion import Promoter
from kvengine.core.tier_set import TierSet
from kvengine.core.tier_writer import TierWriter
from kvengine.errors import ConfigError, KVEngineError
from kvengine.metrics import EngineMetrics
from kvengine.threads import start_thread
from kvengine.tiers import Tier, build_tiers
from kvengine.transport import ChunkTransport
from kvengine.types import ModelBinding

#: Bindings the service remembers at most (one per model and rank; bounds what clients can make it hold).
MAX_BINDINGS = 4096
#: Idle record buffers kept for reads and writes.
_RECORD_POOL_BYTES = 256 * 2**20


class HostTiers:
    """The lower tiers ``config`` configures (disk, peers, Mooncake, ``tiers``), below the service's pools."""

    def __init__(self, config: EngineConfig, *, transports: Sequence[ChunkTransport | Tier] | None = None) -> None:
        """:raises ConfigError: ``config`` configures no lower tier, or one cannot be built."""
        self.config = config
        self.metrics = EngineMetrics()
        self._codecs = default_codecs()
        built = list(transports) if transports is not None else build_tiers(config)
        if not built:
            raise ConfigError("kvengine host --config: the configuration has no lower tier (disk, peers, mooncake "
                              "or tiers); without one, leave --config out")
        self.tiers = TierSet(built, self._codecs, default_codec=config.disk.codec, metrics=self.metrics)
        self._buffers = BufferPool(_RECORD_POOL_BYTES)
        self._bindings: dict[NamespaceDigest, ModelBinding] = {}
        self._parts: dict[MemoryTier, tuple[Promoter, TierWriter]] = {}  # each pool's, made at first use
        self._loop = asyncio.new_event_loop()
        self._thread = start_thread(self._loop.run_forever, "kvengine-host-tiers")

    def describe(self) -> str:
        return self.tiers.describe()

    # -- called from the service's connection threads ------------------------------------------------
    def bind(self, namespace: Namespace, layout: ChunkLayout, digest: NamespaceDigest) -> str | None:
        """Remember the binding whose keys carry ``digest``; None, or why it is refused."""
        binding = ModelBinding.create(namespace, layout)
        if binding.digest != digest:
            return "the namespace and layout do not hash to the binding's digest"
        if digest not in self._bindings and len(self._bindings) >= MAX_BINDINGS:
            return f"the service knows {MAX_BINDINGS} bindings already"
        try:
            self.tiers.check_namespace(namespace)
        except KVEngineError as exc:
            return str(exc)
        self._bindings[digest] = binding
        return None

    def written(self, memory: MemoryTier, pins: Pins) -> None:
        """Queue the committed entry of ``pins`` (of ``memory``; the pin passes on) for the lower tiers.
        Waits while the writer's queue is full, as an in-process store does."""
        binding = self._bindings.get(pins[0].key.namespace)
        if binding is None:  # a client that never bound it: nothing to verify it against later
            pins.release()
            return
        asyncio.run_coroutine_threadsafe(self._hand_off(memory, binding, pins), self._loop).result()

    def promote(self, memory: MemoryTier, digest: NamespaceDigest, keys: list[ChunkKey], first_chunk: int,
                total_tokens: int) -> tuple[int, int]:
        """Bring the longest prefix of ``keys`` the lower tiers hold into ``memory``, verified, and leave it
        unpinned there: (chunks, record bytes read). Bounded by the tiers' own read deadlines."""
        binding = self._binding_of(digest, keys)
        if binding is None or not keys:
            return 0, 0
        return asyncio.run_coroutine_threadsafe(
            self._promote(memory, binding, keys, first_chunk, total_tokens), self._loop).result()

    def promote_each(self, memory: MemoryTier, digest: NamespaceDigest, keys: list[ChunkKey]) -> list[bool]:
        """Keyed chunks: each of ``keys`` the lower tiers hold brought into ``memory``, verified, unpinned;
        whether each is resident now."""
        binding = self._binding_of(digest, keys)
        if binding is None:
            return [False] * len(keys)
        return asyncio.run_coroutine_threadsafe(self._promote_each(memory, binding, keys), self._loop).result()

    def _binding_of(self, digest: NamespaceDigest, keys: list[ChunkKey]) -> ModelBinding | None:
        """The binding a client sent for ``digest``, where every one of ``keys`` is under it; else None."""
        binding = self._bindings.get(digest)
        return binding if binding is not None and all(k.namespace == digest for k in keys) else None

    def close(self) -> None:
        """Write what is queued, close the tiers, stop the loop."""
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    # -- on the loop ------------------------------------------------------------------------------------
    def _of(self, memory: MemoryTier) -> tuple[Promoter, TierWriter]:
        parts = self._parts.get(memory)
        if parts is None:
            writer = TierWriter(memory, self.tiers, self.metrics, write_mode="write_behind",
                                max_pending=self.config.max_pending_writes, record_buffers=self._buffers)
            writer.start()
            parts = self._parts[memory] = Promoter(memory, self.tiers, self._codecs, self.metrics,
                                                       self._buffers), writer
        return parts

    async def _hand_off(self, memory: MemoryTier, binding: ModelBinding, pins: Pins) -> None:
        await self._of(memory)[1].hand_off(binding, pins)

    async def _promote(self, memory: MemoryTier, binding: ModelBinding, keys: list[ChunkKey], first_chunk: int,
                       total_tokens: int) -> tuple[int, int]:
        with await self._of(memory)[0].promote(binding, keys, first_chunk, total_tokens) as promoted:
            # released here: the asking client pins them next, as any resident chunk
            return len(promoted), sum(e.nbytes for e in promoted)

    async def _promote_each(self, memory: MemoryTier, binding: ModelBinding, keys: list[ChunkKey]) -> list[bool]:
        results = await self._of(memory)[0].promote_each(binding, keys)
        release_all(r for r in results if isinstance(r, Pins))  # resident now: the client pins them next
        return [isinstance(r, Pins) for r in results]

    async def _close(self) -> None:
        for _, writer in self._parts.values():
            await writer.close(flush=True)
        await self.tiers.close()

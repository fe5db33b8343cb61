"""The stager: memory slots for new chunks, filled by a store, then committed or aborted.

Every store path goes through it: a prefix store (:meth:`CacheEngine.store`),
a store the caller fills itself (:meth:`CacheEngine.begin_store` /
``commit_store``) and a keyed put (:mod:`.keyed`). Its contract:

* slots are prepared in order and pinned; preparing stops at the first chunk
  that finds no room (a prompt larger than memory never evicts its own head);
* a slot is invisible to lookups until committed, so a half-written chunk is
  never served;
* committing publishes the filled prefix, discards from memory the tails it
  supersedes (:mod:`.tails`) and aborts the rest; the committed
  chunks come back in a :class:`~.pins.Pins` handle for the tier writer
  (empty when there are no lower tiers) -- also when the fill failed
  part-way, so the committed prefix always reaches the tiers;
* a staged store left uncommitted past its deadline is committed as far as it
  was published, and the rest dropped (counted): nothing stays pinned forever.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvengine.chunks.keys import ChunkKey
from kvengine.core.memory_tier import HostMemory, MemoryEntry, Prepared
from kvengine.core.pins import Pins
from kvengine.core.staging import StagedStore
from kvengine.errors import InvalidRequestError
from kvengine.metrics import EngineMetrics
from kvengine.types import ChunkView, ModelBinding, StoreResult

#: Fills one chunk's slot; False: the source has no more (the store ends there).
FillChunk = Callable[[ChunkView], bool]


class Stager:
    def __init__(self, memory: HostMemory, metrics: EngineMetrics, *, hands_on: bool) -> None:
        self.memory = memory
        self.metrics = metrics
        #: Whether committed chunks go on to lower tiers (they then stay pinned for the tier writer).
        self.hands_on = hands_on
        #: Staged stores not committed yet, to the time after which they count as abandoned.
        self._open: dict[StagedStore, float] = {}

    def prepare(self, binding: ModelBinding, keys: Sequence[ChunkKey],
                ranges: Sequence[tuple[int, int]]) -> StagedStore:
        """Slots for the chunks of ``keys`` (token ``ranges``) that memory does not hold, pinned."""
        layout = binding.layout
        present = rejected = 0
        entries: list[MemoryEntry] = []
        views: list[ChunkView] = []
        for i, (key, token_range) in enumerate(zip(keys, ranges)):
            entry = self.memory.prepare(key, layout, token_range)
            if entry is Prepared.PRESENT:
                present += 1
                continue
            if entry is Prepared.NO_ROOM:
                rejected = len(keys) - i
                self.metrics.store_rejected.labels(reason="no_room").inc(rejected)
                self.metrics.log_once("no_room", "kvengine: no room in memory (pinned or in use); "
                                      "the rest of a store is skipped")
                break
            entries.append(entry)
            views.append(ChunkView(i, key, token_range, self.memory.tensors(entry), layout))
        return StagedStore(binding, tuple(views), present, rejected, tuple(entries))

    def fill(self, staged: StagedStore, fill: FillChunk,
             hand_off: Callable[[Pins], object] | None = None) -> tuple[int, BaseException | None]:
        """Fill the slots in order with ``fill``: how many were filled, and what it raised, if it did.

        With ``hand_off``, each chunk is committed as soon as it is filled and
        its pin passed to ``hand_off``; :meth:`commit` then settles the rest.
        """
        filled = 0
        try:
            for view, entry in zip(staged.chunks, staged.entries):
                if not fill(view):
                    break
                filled += 1
                if hand_off is not None:
                    pins = Pins.commit(self.memory, (entry,))
                    staged.published = filled
                    hand_off(pins)
        except BaseException as exc:  # the caller raises it once the filled chunks are committed
            return filled, exc
        return filled, None

    def commit(self, staged: StagedStore, filled: int) -> tuple[StoreResult, Pins]:
        """Publish the first ``filled`` chunks, abort the rest; the result and the chunks to hand on.

        :raises InvalidRequestError: if ``staged`` was already committed (or abandoned and dropped).
        """
        if staged.committed:
            raise InvalidRequestError("this staged store was already committed")
        self._open.pop(staged, None)
        staged.committed = True
        filled = max(staged.published, min(filled, len(staged.entries)))
        held = Pins.commit(self.memory, staged.entries[staged.published : filled])  # not handed on yet
        for entry in staged.entries[filled:]:
            self.memory.abort(entry)
        for keys in staged.supersedes[:filled]:
            for key in keys:
                if self.memory.discard(key):  # pinned (a load holds it): stays until evicted
                    self.metrics.tails_superseded.inc()
        model = staged.binding.namespace.model
        self.metrics.stored_bytes.labels(tier="memory", model=model).inc(sum(e.nbytes for e in staged.entries[:filled]))
        self.metrics.stored_chunks.labels(tier="memory", model=model).inc(filled)
        unused = len(staged.entries) - filled
        result = StoreResult(filled, staged.present_chunks, staged.rejected_chunks + unused)
        if not self.hands_on:
            held.release()
        return result, held

    def keep_open(self, staged: StagedStore, deadline: float) -> None:
        """Track a store the caller fills itself: past ``deadline`` it is abandoned (see :meth:`reclaim`)."""
        if staged.entries:
            self._open[staged] = deadline

    def reclaim(self, now: float) -> int:
        """Commit every open store past its deadline as far as it was published, dropping the rest; how many."""
        count = 0
        for staged, deadline in list(self._open.items()):
            if deadline < now and not staged.committed:
                self.commit(staged, staged.published)
                self.metrics.abandoned.labels(op="store").inc()
                count += 1
        return count

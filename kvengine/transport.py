"""The plug-in seam for tiers below memory (local disk, peers).

A transport stores opaque, self-verifying chunk records (see
:mod:`kvengine.chunks.record`) under :class:`ChunkKey`. Every method is batched and
async; none may block the event loop (use a thread pool or async I/O).

Guarantees a transport must give:

* ``put`` publishes a record atomically: a concurrent or later ``get`` sees
  either nothing or the whole record, never a torn one.
* ``get`` returns the stored bytes or None. It may return corrupt bytes; the
  engine verifies every record with :func:`kvengine.chunks.record.unpack_record`
  (and its token position, layout and verification flag) before use, and
  removes a bad copy where it was read: with :meth:`RejectsCopies.reject` on a
  transport holding several copies of a chunk (the next copy is then tried),
  else with ``delete`` (the one copy).
* Faults (I/O errors, timeouts, full disks, dead peers) are reported as
  False / None results, never raised, except for caller mistakes.
* A transport with a read deadline counts it from :func:`read_deadline`: the
  engine opens one :func:`read_scope` per lookup, so all the reads of one
  lookup (``exists``, then ``get`` window after window) share one deadline.

Optional capabilities (:class:`Capability`) are declared one way: listed in the
transport's ``capabilities``, each implemented by the method its protocol names
(:class:`ReadsInPlace`, :class:`WritesGathered`, :class:`RejectsCopies`). A
method alone declares nothing (a wrapper may forward one it cannot honour); a
capability listed without its method is refused when the engine starts.

Third-party transports register under the ``kvengine.transports`` entry-point
group; the value is a factory ``(config: dict) -> ChunkTransport``.
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeGuard, runtime_checkable

from kvengine.chunks.keys import ChunkKey
from kvengine.errors import ConfigError, InvalidRequestError

if TYPE_CHECKING:
    from kvengine.chunks.record import RecordHeader

Buffer = bytes | bytearray | memoryview

@dataclass(frozen=True, slots=True)
class ReadScope:
    """How the reads of one lookup may go, where the caller knows more than the tiers' defaults."""

    #: seconds the reads may take, in place of each transport's own deadline and request timeout (None:
    #: the transports' own): for a read the caller waits for whatever its size, such as a prompt a
    #: producer handed off, where a miss costs a whole prefill
    budget: float | None = None
    #: ``host:port`` of a peer known to hold these records (the producer that computed a handed-off
    #: prompt): a peer tier asks it first, before the peers its placement picks (None: placement alone)
    source: str | None = None

    def __post_init__(self) -> None:
        if self.budget is not None and not self.budget > 0:
            raise InvalidRequestError(f"ReadScope.budget must be > 0 seconds, got {self.budget!r}")


@dataclass(frozen=True, slots=True)
class _OpenScope:
    start: float
    scope: ReadScope


#: The enclosing read scope (None outside one). Tasks started inside a scope inherit it.
_SCOPE: ContextVar[_OpenScope | None] = ContextVar("kvengine_read_scope", default=None)


@contextlib.contextmanager
def read_scope(scope: ReadScope | None = None) -> Iterator[None]:
    """Mark the reads of one lookup: inside, :func:`read_deadline` counts from the scope's start, and
    ``scope`` (None: the defaults) says what the caller knows of them (:class:`ReadScope`).

    A nested scope keeps the outer one, so a lookup's deadline cannot be renewed from within it.
    """
    if _SCOPE.get() is not None:
        yield
        return
    token = _SCOPE.set(_OpenScope(time.monotonic(), scope or ReadScope()))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def read_budget(configured: float) -> float:
    """The enclosing scope's budget where it sets one, else a transport's ``configured`` seconds."""
    open_scope = _SCOPE.get()
    budget = None if open_scope is None else open_scope.scope.budget
    return configured if budget is None else budget


def read_source() -> str | None:
    """The enclosing scope's :attr:`ReadScope.source` (None: none, or outside a scope)."""
    open_scope = _SCOPE.get()
    return None if open_scope is None else open_scope.scope.source


def read_deadline(budget: float) -> float:
    """The ``time.monotonic()`` by which a read allowed ``budget`` seconds (a transport's own) must end.

    Counted from the start of the enclosing :func:`read_scope` (one lookup's reads share it), else
    from now; the scope's own budget, where it sets one, replaces ``budget``.
    """
    open_scope = _SCOPE.get()
    return (time.monotonic() if open_scope is None else open_scope.start) + read_budget(budget)


@runtime_checkable
class ChunkTransport(Protocol):
    name: str

    async def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        """Store each record; True where it is now durable per the transport's policy."""
        ...

    async def get(self, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
        """The stored record bytes for each key, or None on a miss or fault."""
        ...

    async def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Whether each key is (probably) stored; a True may still miss on ``get``."""
        ...

    async def delete(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Remove each key (used for corrupt records too); True where something was removed."""
        ...

    async def close(self) -> None: ...


class TierStats(Protocol):
    """What a transport's optional ``stats()`` reports (exported as Prometheus metrics)."""

    chunks: int
    used_bytes: int
    evictions: int
    integrity_reasons: Mapping[str, int]
    put_failures: Mapping[str, int]


@dataclass(frozen=True, slots=True)
class RemoteTierStats:
    """The :class:`TierStats` of a tier whose chunks live elsewhere (peers, a cluster): what it counted,
    and nothing held here."""

    integrity_reasons: Mapping[str, int]
    put_failures: Mapping[str, int]
    chunks: int = 0
    used_bytes: int = 0
    evictions: int = 0


@runtime_checkable
class ReportsStats(Protocol):
    def stats(self) -> TierStats: ...


class Capability(enum.Enum):
    """An optional transport capability: listed in the transport's ``capabilities``, implemented by ``method``."""

    PLACED_READS = "get_into"  # ReadsInPlace
    GATHERED_WRITES = "put_parts"  # WritesGathered
    REJECTS_COPIES = "reject"  # RejectsCopies

    @property
    def method(self) -> str:
        return str(self.value)


def capabilities_of(transport: ChunkTransport) -> frozenset[Capability]:
    """The capabilities ``transport`` declares (none without a ``capabilities`` attribute), checked: the engine
    calls it for each of its tiers when it starts (:class:`~kvengine.core.tier_set.TierSet`), so that the
    guards below, on the read and write paths, only look the capability up.

    :raises ConfigError: ``capabilities`` holds something else than :class:`Capability` members, or one whose
        method the transport lacks (refused when the engine starts, naming both).
    """
    declared: object = getattr(transport, "capabilities", frozenset())
    if not isinstance(declared, (set, frozenset)) or not all(isinstance(c, Capability) for c in declared):
        raise ConfigError(f"transport {transport.name!r}: capabilities must be a set of kvengine.transport."
                          f"Capability members, got {declared!r}")
    missing = sorted(c.name for c in declared if not callable(getattr(transport, c.method, None)))
    if missing:
        raise ConfigError(f"transport {transport.name!r} declares {', '.join(missing)} without the method "
                          f"({', '.join(Capability[m].method for m in missing)})")
    return frozenset(declared)


class ReadsInPlace(ChunkTransport, Protocol):
    """Optional: a transport that reads a record's payload straight into a buffer chosen from its header.

    ``get_into(key, place)`` reads and verifies the header, calls
    ``place(header)`` for the destination (None stops the read), reads the
    payload into it and verifies the payload checksum there, once. It returns
    the header, or None on a miss, a declined or a corrupt record (deleted and
    counted). The engine then skips its own buffers and second verification.
    Declared by :attr:`Capability.PLACED_READS`.
    """

    async def get_into(self, key: ChunkKey, out: Callable[[RecordHeader], Buffer | None]) -> RecordHeader | None: ...


class WritesGathered(ChunkTransport, Protocol):
    """Optional: a transport that takes each record as parts (header, payload) and writes them as one.

    ``put_parts`` has the contract of ``put``; a record is the concatenation
    of its parts. The engine then hands over the payload where it lies (a
    memory slot) instead of first copying it next to its header. Declared by
    :attr:`Capability.GATHERED_WRITES`.
    """

    async def put_parts(self, items: Sequence[tuple[ChunkKey, Sequence[Buffer]]]) -> list[bool]: ...


class RejectsCopies(ChunkTransport, Protocol):
    """Optional: a transport holding several copies of a chunk (replicas at several owners) that knows where
    each copy ``get`` returned came from.

    ``reject(key, copy)`` is the engine's verdict on ``copy``, the very buffer a ``get`` returned for
    ``key``, which failed the engine's checks: the transport removes that copy at its source only (the
    other copies are good until shown otherwise) and returns the next source's copy of ``key``, passed
    through the transport's own checks and read within the same :func:`read_deadline`, or None when no
    source is left. Each source of a key is offered at most once per ``get``, so a chain of rejections
    ends after at most the number of copies. A ``copy`` whose source the transport no longer knows is
    left where it is (None). The engine then uses ``reject``, never ``delete``, for a bad copy; a
    transport without it holds one copy of each chunk, and ``delete`` removes that.

    Placed reads (:class:`ReadsInPlace`) return no buffer to name a copy by: a transport offering both
    has its placed reads' bad copies removed with ``delete``. Declared by :attr:`Capability.REJECTS_COPIES`.
    """

    async def reject(self, key: ChunkKey, copy: Buffer) -> Buffer | None: ...


def _declares(transport: ChunkTransport, capability: Capability) -> bool:
    return capability in getattr(transport, "capabilities", ())


def rejects_copies(transport: ChunkTransport) -> TypeGuard[RejectsCopies]:
    """Whether ``transport`` declares :attr:`Capability.REJECTS_COPIES`."""
    return _declares(transport, Capability.REJECTS_COPIES)


def reads_in_place(transport: ChunkTransport) -> TypeGuard[ReadsInPlace]:
    """Whether ``transport`` declares :attr:`Capability.PLACED_READS`."""
    return _declares(transport, Capability.PLACED_READS)


def writes_gathered(transport: ChunkTransport) -> TypeGuard[WritesGathered]:
    """Whether ``transport`` declares :attr:`Capability.GATHERED_WRITES`."""
    return _declares(transport, Capability.GATHERED_WRITES)

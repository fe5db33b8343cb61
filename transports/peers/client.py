"""The client side of peer sharing: a :class:`ChunkTransport` that routes to owners.

:class:`PeerTransport` is wire-independent; a :class:`Connector` (ZeroMQ in
:mod:`.zmq`, UCX in :mod:`.ucx`) carries one request to one peer.

Routing (see :mod:`.placement`): each key's owners are the ``replicas``
rendezvous winners over the current membership, minus peers in cool-down.

* ``put`` sends each record to every live owner; True where one acked.
  Writes hold a byte budget (``max_inflight_write_bytes``) while in flight;
  a write that gets no budget within ``write_timeout`` is dropped (False,
  counted), so nothing queues without bound.
* ``exists`` asks every live owner at once; True where one has it (that
  owner is remembered as a hint for the following ``get``).
* ``get`` asks the hinted or first live owner, then, for what is still
  missing, the next owner, and so on, all within ``read_deadline``, counted
  from the start of the engine's lookup (:func:`kvengine.transport.read_scope`):
  one lookup's ``exists`` and every ``get`` window share one deadline.
* ``delete`` goes to every live owner.
* ``reject`` (:class:`kvengine.transport.RejectsCopies`): a copy ``get``
  returned that the engine refused (wrong token position, layout, ...) is
  deleted at the owner that served it only, and the next owner's copy is
  read in its place, within the same read deadline. A copy this client
  refuses itself (header, checksum, MAC) is handled the same way in ``get``.

Faults: a request that gets no answer within its timeout, or whose peer
disconnects, is a miss and puts the peer in cool-down. A reply that is
malformed, refused, or holds a record whose header names another key is a
miss (counted); bytes for a key other than the one asked for are never
returned. Nothing here raises for a cache fault.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from kvengine.addresses import is_loopback
from kvengine.chunks.keys import ChunkKey
from kvengine.chunks.record import seal_record, verify_record, verify_seal
from kvengine.config import PeersConfig
from kvengine.errors import ConfigError, IntegrityError
from kvengine.transport import Buffer, Capability, RemoteTierStats, read_budget, read_deadline, read_source
from kvengine.trust.secrets import read_secret_file

from .byte_budget import ByteBudget
from .placement import Membership, Peer, PeerHealth, rendezvous_owners
from .protocol import Limits, Message, Op, Status

#: A reply: its decoded header and one record per item (``b""`` where it carries none).
Answer = tuple[Message, list[Buffer]]

_HINTS = 4096
#: Copies returned by ``get`` whose owner is remembered (for :meth:`PeerTransport.reject`): far more than the
#: read windows of every lookup in flight hold (a copy forgotten before the engine judged it is left where it
#: is, rejected again on its next read, never deleted elsewhere).
_SOURCES = 16384
#: Records up to this size are verified on the event loop (under 0.15 ms even with a MAC), larger ones in a
#: worker thread (a thread hop costs about as much as checking a small record).
_INLINE_CHECK_BYTES = 256 << 10


class Connector(Protocol):
    """Carries requests to peers over one wire."""

    async def request(
        self, peer: Peer, op: Op, keys: Sequence[ChunkKey], records: Sequence[Buffer], timeout: float
    ) -> Answer | None:
        """Send one request and wait for its reply; None on timeout, disconnect or send failure."""
        ...

    async def forget(self, peer: Peer) -> None:
        """Drop any connection to a peer that left the membership."""
        ...

    async def close(self) -> None: ...


#: The engine configuration's peer settings are the defaults here too (one place for them).
_CONFIGURED = PeersConfig()


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerClientOptions:
    replicas: int = _CONFIGURED.replicas
    #: One request to one peer.
    request_timeout: float = _CONFIGURED.request_timeout
    #: A whole lookup's reads (``exists``, every ``get``), all owners and retries included.
    read_deadline: float = _CONFIGURED.read_deadline
    #: A whole ``put`` / ``delete`` call, waiting for write budget included.
    write_timeout: float = _CONFIGURED.write_timeout
    #: A peer that failed is skipped this long.
    cooldown: float = _CONFIGURED.cooldown
    max_keys_per_request: int = 16
    max_request_bytes: int = 64 << 20
    max_inflight_write_bytes: int = int(_CONFIGURED.max_inflight_write_bytes)
    limits: Limits = field(default_factory=Limits)
    #: Shared secret of the peer group: records sent are sealed with it (a keyed MAC over header and
    #: payload) and records received must verify under it, or they are counted misses. None: records
    #: are only checked for integrity (checksums), not origin.
    secret: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.max_keys_per_request < 1:
            raise ValueError("replicas and max_keys_per_request must be >= 1")
        if self.secret is not None and len(self.secret) < 16:
            raise ValueError("the peers secret must be at least 16 bytes (32 random bytes recommended)")
        if min(self.request_timeout, self.read_deadline, self.write_timeout, self.cooldown) <= 0:
            raise ValueError("peer timeouts and cool-down must be > 0")


#: How an engine's ``peers`` section protects its peers (the default remedy of :func:`require_protection`).
PEERS_REMEDY = ("Set peers.secret_file (records authenticated with a keyed MAC; required for UCX, which has no "
                "transport security) or the peers.curve_* keys (ZeroMQ CURVE) or peers.tls_ca (tcp with TLS)")


def require_protection(addresses: Sequence[str], *, secret: bytes | None, encrypted: bool, what: str,
                       remedy: str = PEERS_REMEDY) -> None:
    """Fail closed: ``host:port`` addresses off loopback need a shared secret (records authenticated) or an
    encrypted, authenticated wire (CURVE, TLS). The refusal names the caller's setting ``what`` and says
    ``remedy`` (the caller's settings that protect it)."""
    remote = [a for a in addresses if not is_loopback(a.rpartition(":")[0].strip("[]"))]
    if remote and secret is None and not encrypted:
        raise ConfigError(
            f"{what} {', '.join(remote[:3])} {'is' if len(remote) == 1 else 'are'} "
            f"not on loopback: anyone who reaches them could serve or plant KV. {remedy}, or stay on 127.0.0.0/8")


def client_from_section(peers: PeersConfig, *, encrypted: bool) -> tuple[Membership, PeerClientOptions]:
    """Membership and :class:`PeerClientOptions` of an engine's typed ``peers`` section. Peers off
    loopback are refused unless records are authenticated (``secret_file``) or the wire is ``encrypted``."""
    secret = read_secret_file(peers.secret_file, "peers.secret_file")
    membership = _membership(peers.peers, peers.peers_file, peers.reload_interval, secret, encrypted)
    try:
        options = PeerClientOptions(replicas=peers.replicas, request_timeout=peers.request_timeout,
                                    read_deadline=peers.read_deadline, write_timeout=peers.write_timeout,
                                    cooldown=peers.cooldown, max_inflight_write_bytes=int(peers.max_inflight_write_bytes),
                                    secret=secret)
    except ValueError as exc:
        raise ConfigError(f"invalid peers config: {exc}") from None
    return membership, options


def _membership(addresses: Sequence[str], path: Any, reload_interval: float, secret: bytes | None,
                encrypted: bool) -> Membership:
    def protected(peers: tuple[Peer, ...]) -> None:  # at start and on every reload of peers_file
        require_protection([f"{p.host}:{p.port}" for p in peers], secret=secret, encrypted=encrypted, what="peers")

    return Membership(addresses, path=path, reload_interval=reload_interval, validate=protected)


def client_from_config(config: dict[str, Any], name: str, *, encrypted: bool = False) -> tuple[Membership,
                                                                                                PeerClientOptions]:
    """Pop the membership and :class:`PeerClientOptions` keys out of a transport factory's config.

    Keys: ``peers`` (list of ``host:port``) and/or ``peers_file``,
    ``reload_interval``, ``secret_file``, and the fields of
    :class:`PeerClientOptions` (except ``limits`` and ``secret``). What is
    left in ``config`` is the wire's. Peers off loopback are refused unless
    records are authenticated (``secret_file``) or the wire is ``encrypted``.
    """
    secret = read_secret_file(config.pop("secret_file", None), "peers.secret_file")
    membership = _membership(config.pop("peers", ()), config.pop("peers_file", None),
                             float(config.pop("reload_interval", _CONFIGURED.reload_interval)), secret, encrypted)
    fields = {f.name for f in dataclasses.fields(PeerClientOptions)} - {"limits", "secret"}
    try:
        options = PeerClientOptions(**{k: config.pop(k) for k in list(config) if k in fields}, secret=secret)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid {name} transport config: {exc}") from None
    return membership, options


@dataclass(frozen=True, slots=True)
class _Source:
    """Where a copy returned by ``get`` came from, and the owners not yet asked for that key, in order."""

    peer: Peer
    rest: tuple[Peer, ...]


class PeerTransport:
    """A :class:`kvengine.transport.ChunkTransport` over peer servers; a bad copy is discarded at the owner
    that served it (:class:`kvengine.transport.RejectsCopies`)."""

    #: :meth:`reject` discards a copy at its source and reads the next owner's.
    capabilities = frozenset({Capability.REJECTS_COPIES})

    def __init__(
        self, connector: Connector, membership: Membership, options: PeerClientOptions | None = None,
        *, name: str = "peers",
    ) -> None:
        self.name = name
        self.connector = connector
        self.membership = membership
        self.options = options or PeerClientOptions()
        self.health = PeerHealth(self.options.cooldown)
        self.counts: Counter[str] = Counter()
        self._hints: OrderedDict[ChunkKey, Peer] = OrderedDict()
        self._sources: OrderedDict[tuple[ChunkKey, int], _Source] = OrderedDict()
        self._budget = ByteBudget(self.options.max_inflight_write_bytes)
        self._known: tuple[Peer, ...] = ()

    # -- routing -----------------------------------------------------------------
    async def _owners(self, keys: Sequence[ChunkKey]) -> list[list[Peer]]:
        peers = await self.membership.refresh()
        if peers != self._known:
            for gone in set(self._known) - set(peers):
                await self.connector.forget(gone)
            self._known = peers
        if not peers:
            return [[] for _ in keys]
        return [[p for p in rendezvous_owners(k, peers, self.options.replicas) if self.health.usable(p)] for k in keys]

    async def _read_owners(self, keys: Sequence[ChunkKey]) -> list[list[Peer]]:
        """:meth:`_owners` for reads, after the enclosing read scope's source where it is one of the peers
        (a consumer asks the producer that computed a prompt first, whatever placement picks)."""
        owners = await self._owners(keys)
        address = read_source()
        if address is None:
            return owners
        try:
            source: Peer | None = Peer.parse(address)
        except ConfigError:
            source = None
        if source not in self._known or not self.health.usable(source):
            self.counts["read_source_unusable"] += 1
            return owners
        return [[source, *(p for p in peers if p != source)] for peers in owners]

    def _batches(self, indices: list[int], sizes: Sequence[int] | None = None) -> Iterator[list[int]]:
        batch: list[int] = []
        nbytes = 0
        for i in indices:
            size = sizes[i] if sizes is not None else 0
            if batch and (len(batch) == self.options.max_keys_per_request
                          or nbytes + size > self.options.max_request_bytes):
                yield batch
                batch, nbytes = [], 0
            batch.append(i)
            nbytes += size
        if batch:
            yield batch

    async def _call(
        self, peer: Peer, op: Op, keys: Sequence[ChunkKey], records: Sequence[Buffer], deadline: float
    ) -> Answer | None:
        # inside a read scope with its own budget (a handed-off prompt), one request may take all of it
        limit = read_budget(self.options.request_timeout) if op in (Op.GET, Op.EXISTS) else self.options.request_timeout
        timeout = min(limit, deadline - time.monotonic())
        if timeout <= 0:
            self.counts["deadline_passed"] += 1
            return None
        self.counts[f"requests_{op.name.lower()}"] += 1
        reply = await self.connector.request(peer, op, keys, records, timeout)
        if reply is None:
            self.counts["peer_failures"] += 1
            self.health.failed(peer)
            return None
        msg = reply[0]
        if msg.status is not Status.OK or msg.op is not op or len(msg.flags) != len(keys):
            self.counts[f"refused_{msg.status.name.lower()}"] += 1
            return None
        self.health.succeeded(peer)
        return reply

    def _hint(self, key: ChunkKey, peer: Peer) -> None:
        self._hints[key] = peer
        self._hints.move_to_end(key)
        if len(self._hints) > _HINTS:
            self._hints.popitem(last=False)

    async def _to_owners(
        self, op: Op, keys: Sequence[ChunkKey], deadline: float, records: Sequence[Buffer] = ()
    ) -> list[bool]:
        """Send ``op`` for each key to every live owner at once; True where an owner said True."""
        out = [False] * len(keys)
        sizes = [len(r) for r in records] if records else None
        by_peer: dict[Peer, list[int]] = defaultdict(list)
        for i, owners in enumerate(await (self._read_owners(keys) if op is Op.EXISTS else self._owners(keys))):
            for peer in owners:
                by_peer[peer].append(i)

        async def one(peer: Peer, batch: list[int]) -> None:
            held = 0
            if sizes is not None:  # writes hold part of the in-flight budget
                held = sum(sizes[i] for i in batch)
                if not await self._budget.take(held, max(deadline - time.monotonic(), 0)):
                    self.counts["writes_dropped_backpressure"] += len(batch)
                    return
            try:
                reply = await self._call(peer, op, [keys[i] for i in batch], [records[i] for i in batch] if sizes
                                         else (), deadline)
            finally:
                if held:
                    self._budget.give(held)
            for i, ok in zip(batch, reply[0].flags if reply is not None else ()):
                if ok and not out[i]:
                    out[i] = True
                    if op is Op.EXISTS:
                        self._hint(keys[i], peer)

        await _all([one(p, b) for p, idx in by_peer.items() for b in self._batches(idx, sizes)])
        return out

    # -- ChunkTransport --------------------------------------------------------------
    async def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return await self._to_owners(Op.EXISTS, keys, read_deadline(self.options.read_deadline))

    async def get(self, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
        deadline = read_deadline(self.options.read_deadline)
        out: list[Buffer | None] = [None] * len(keys)
        served_by: list[int] = [0] * len(keys)  # the rank of the owner whose copy is in ``out``
        candidates = []
        for key, owners in zip(keys, await self._read_owners(keys)):
            hinted = self._hints.pop(key, None)
            if hinted in owners:
                owners.remove(hinted)
                owners.insert(0, hinted)
            candidates.append(owners)

        async def fetch(peer: Peer, batch: list[int], rank: int) -> None:
            for i, record in zip(batch, await self._fetch(peer, [keys[i] for i in batch], deadline)):
                if record is not None:
                    out[i], served_by[i] = record, rank

        for rank in range(max(map(len, candidates), default=0)):  # a read source adds one to the owners
            by_peer: dict[Peer, list[int]] = defaultdict(list)
            for i, owners in enumerate(candidates):
                if out[i] is None and rank < len(owners):
                    by_peer[owners[rank]].append(i)
            if not by_peer or time.monotonic() >= deadline:
                break
            await _all([fetch(p, b, rank) for p, idx in by_peer.items() for b in self._batches(idx)])
        for key, record, owners, rank in zip(keys, out, candidates, served_by):
            if record is not None:
                self._remember(key, record, owners[rank], owners[rank + 1 :])
        hits = sum(r is not None for r in out)
        self.counts["hits"] += hits
        self.counts["misses"] += len(keys) - hits
        return out

    async def reject(self, key: ChunkKey, copy: Buffer) -> Buffer | None:
        """The engine found ``copy`` (returned by :meth:`get` for ``key``) bad: delete it at the owner that
        served it, and return the next owner's copy of ``key`` (checked here like any other), if one has it
        (:class:`kvengine.transport.RejectsCopies`). The other owners' copies are not touched."""
        source = self._sources.pop((key, id(copy)), None)
        if source is None:  # too many reads since: not known where it came from, so deleted nowhere
            self.counts["rejected_source_unknown"] += 1
            return None
        self.counts["rejected_by_engine"] += 1  # why is counted by the engine (its integrity failures)
        deadline = read_deadline(self.options.read_deadline)
        # Within the lookup's read deadline too: a liar slow to answer DELETE must not hold up the read
        # (a delete cut short leaves the bad copy there, rejected again on its next read).
        deleting = asyncio.ensure_future(self._discard_at(source.peer, [key], deadline))
        try:
            rest = [p for p in source.rest if self.health.usable(p)]
            for n, peer in enumerate(rest):
                if time.monotonic() >= deadline:
                    break
                record = (await self._fetch(peer, [key], deadline))[0]
                if record is not None:
                    self._remember(key, record, peer, rest[n + 1 :])
                    self.counts["hits_after_reject"] += 1
                    return record
            return None
        finally:
            await deleting

    def _remember(self, key: ChunkKey, record: Buffer, peer: Peer, rest: Sequence[Peer]) -> None:
        """Note where the copy ``record`` of ``key`` came from, for :meth:`reject`. Named by the buffer's
        identity: two reads of one key at once may be served by different owners."""
        self._sources[(key, id(record))] = _Source(peer, tuple(rest))
        self._sources.move_to_end((key, id(record)))
        if len(self._sources) > _SOURCES:
            self._sources.popitem(last=False)

    async def _fetch(self, peer: Peer, keys: Sequence[ChunkKey], deadline: float) -> list[Buffer | None]:
        """``peer``'s copies of ``keys`` that pass :meth:`_rejects` (None where it has none or a bad one);
        a bad copy is counted and deleted at ``peer``, never elsewhere."""
        out: list[Buffer | None] = [None] * len(keys)
        reply = await self._call(peer, Op.GET, keys, (), deadline)
        if reply is None:
            return out
        msg, records = reply
        bad: list[ChunkKey] = []
        for i, (key, present, record) in enumerate(zip(keys, msg.flags, records)):
            if not present:
                continue
            reason = await self._rejects(key, record)
            if reason is None:
                out[i] = record
                self.counts["bytes_received"] += len(record)
            else:
                self.counts[f"wrong_record_{reason}"] += 1
                bad.append(key)
        if bad:
            await self._discard_at(peer, bad, deadline)
        return out

    async def _discard_at(self, peer: Peer, keys: Sequence[ChunkKey], deadline: float) -> None:
        """Delete bad copies of ``keys`` at ``peer`` only, the owner that served them."""
        for key in keys:
            self._hints.pop(key, None)
        await self._call(peer, Op.DELETE, keys, (), deadline)

    async def _rejects(self, key: ChunkKey, record: Buffer) -> str | None:
        """Why a received record must not be used (None: use it): its header (naming ``key``, of its length),
        its checksum and, with a secret, its MAC. A bad copy is a miss at this owner, never served and never
        forwarded."""
        secret = self.options.secret
        view = memoryview(record)
        check = partial(verify_seal, secret=secret) if secret is not None else verify_record
        try:
            if view.nbytes > _INLINE_CHECK_BYTES:
                await asyncio.to_thread(check, view, expect_key=key)
            else:  # a thread hop would cost more than checking a small record here
                check(view, expect_key=key)
        except IntegrityError as exc:
            return exc.reason
        return None

    async def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        deadline = time.monotonic() + self.options.write_timeout
        secret = self.options.secret
        if secret is not None:  # every record that leaves this node says who wrote it
            items = await asyncio.to_thread(lambda: [(k, seal_record(memoryview(r), secret)) for k, r in items])
        out = await self._to_owners(Op.PUT, [k for k, _ in items], deadline, [r for _, r in items])
        self.counts["bytes_sent"] += sum(len(r) for (_, r), ok in zip(items, out) if ok)
        self.counts["puts_acked"] += sum(out)
        self.counts["puts_failed"] += len(out) - sum(out)
        return out

    async def delete(self, keys: Sequence[ChunkKey]) -> list[bool]:
        for key in keys:
            self._hints.pop(key, None)
        return await self._to_owners(Op.DELETE, keys, time.monotonic() + self.options.write_timeout)

    async def close(self) -> None:
        await self.connector.close()

    def stats(self) -> RemoteTierStats:
        """Records rejected (by reason: checksum, MAC, header) and puts refused, for the engine's metrics."""
        counts = dict(self.counts)
        prefix = "wrong_record_"
        return RemoteTierStats(integrity_reasons={k[len(prefix):]: v for k, v in counts.items() if k.startswith(prefix)},
                         put_failures={"refused": counts.get("puts_failed", 0)})


async def _all(calls: list[Coroutine[Any, Any, None]]) -> None:
    """Run ``calls`` concurrently; one alone is awaited in place (a task costs a loop turn more)."""
    if len(calls) == 1:
        await calls[0]
    elif calls:
        await asyncio.gather(*calls)

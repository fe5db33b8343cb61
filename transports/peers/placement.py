"""Which peers own a chunk, who the peers are, and which of them are alive.

Primitives:

* :func:`rendezvous_owners` -- highest-random-weight (rendezvous) hashing:
  every peer gets the score ``xxh3_64(peer id, key)`` and the ``replicas``
  highest scores own the key. Stable across processes and machines (xxhash,
  no seed, no Python ``hash``); adding or removing one peer moves only the
  keys that peer gains or loses (about ``1/n`` of them).
* :class:`Membership` -- the peer list, static or read from a file that may
  change at runtime (re-read when its mtime or size changes, checked at most
  every ``reload_interval`` seconds, off the event loop with
  :meth:`Membership.refresh`; a file that cannot be read or parsed, or a
  list its ``validate`` refuses, keeps the last good list). Changing the
  list moves owners, so it costs misses; it never serves wrong data
  (records are keyed and verified).
* :class:`PeerHealth` -- a peer that times out or fails is skipped for a
  cool-down; after it, the next request tries it again.

A peer is named by its address ``host:port`` (IPv6 as ``[::1]:port``); the
address is the identity that is hashed, so every node must list the same
addresses for the same peers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvengine.addresses import format_address, split_host_port
from kvengine.chunks.keys import ChunkKey
from kvengine.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, order=True)
class Peer:
    """One peer server, addressed by host and port."""

    host: str
    port: int

    def __post_init__(self) -> None:
        if not self.host or not 0 < self.port < 65536:
            raise ConfigError(f"invalid peer address {self.host!r}:{self.port}")

    @property
    def address(self) -> str:
        """``host:port`` -- the identity that placement hashes."""
        return format_address(self.host, self.port)

    @classmethod
    def parse(cls, text: str) -> Peer:
        """Parse ``host:port``, ``[v6]:port`` or ``tcp://host:port``."""
        return cls(*split_host_port(text))


def _score(peer: Peer, key_bytes: bytes) -> int:
    return xxhash.xxh3_64_intdigest(peer.address.encode() + b"\0" + key_bytes)


def rendezvous_owners(key: ChunkKey, peers: Sequence[Peer], replicas: int) -> list[Peer]:
    """The ``replicas`` owners of ``key`` among ``peers``, best first (ties broken by address)."""
    if replicas < 1:
        raise ConfigError(f"replicas must be >= 1, got {replicas}")
    key_bytes = key.namespace + key.chunk_hash
    ranked = sorted(peers, key=lambda p: (_score(p, key_bytes), p.address), reverse=True)
    return ranked[:replicas]


def parse_peer_list(lines: Iterable[str]) -> tuple[Peer, ...]:
    """Peers from lines of ``host:port``; blank lines and ``#`` comments ignored, duplicates dropped."""
    peers: dict[str, Peer] = {}
    for line in lines:
        text = line.split("#", 1)[0].strip()
        if text:
            peer = Peer.parse(text)
            peers.setdefault(peer.address, peer)
    return tuple(peers.values())


class Membership:
    """The current peer list: static, or a file re-read when it changes."""

    def __init__(
        self,
        peers: Iterable[Peer | str] = (),
        *,
        path: str | os.PathLike[str] | None = None,
        reload_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        validate: Callable[[tuple[Peer, ...]], None] | None = None,
    ) -> None:
        """``validate`` raises :class:`ConfigError` for a list that must not be used (checked at start,
        where it raises, and on every reload, where the list is refused and the last good one kept)."""
        self._validate = validate
        self._static = parse_peer_list(p.address if isinstance(p, Peer) else p for p in peers)
        self._path = Path(path) if path is not None else None
        self._interval = reload_interval
        self._clock = clock
        self._stamp: tuple[int, int, int] | None = None
        self._next_check = float("-inf")
        self._peers = self._static
        self.version = 0  # incremented on every change of the list after construction
        self.refused_reloads = 0
        self._reload: asyncio.Future[None] | None = None
        if validate is not None:
            validate(self._static)
        if self._path is not None:
            self._check(force=True)
            self.version = 0

    def peers(self) -> tuple[Peer, ...]:
        """The current list (re-reads the file first if it changed; blocking: on a loop, use :meth:`refresh`)."""
        if self._path is not None:
            self._check()
        return self._peers

    async def refresh(self) -> tuple[Peer, ...]:
        """The current list; a due re-read of the file runs in a worker thread, and callers that come
        while it runs wait for it (one event loop's callers; none gets the list it is replacing)."""
        if self._path is None:
            return self._peers
        if self._reload is None and self._clock() >= self._next_check:
            self._reload = asyncio.ensure_future(asyncio.to_thread(self._check))
        reload = self._reload
        if reload is not None:
            try:
                await asyncio.shield(reload)
            finally:
                if reload.done() and self._reload is reload:
                    self._reload = None
        return self._peers

    def _check(self, *, force: bool = False) -> None:
        now = self._clock()
        if not force and now < self._next_check:
            return
        self._next_check = now + self._interval
        assert self._path is not None
        try:
            st = self._path.stat()
            # The inode too: a list replaced atomically (rename) may keep size and mtime (coarse clocks).
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            if stamp == self._stamp:
                return
            peers = parse_peer_list(self._path.read_text().splitlines())
        except (OSError, ConfigError) as exc:
            if force:
                raise ConfigError(f"cannot read peer list {self._path}: {exc}") from None
            log.warning("kvengine: peer list %s unreadable (%s); keeping %d peers", self._path, exc, len(self._peers))
            return
        self._stamp = stamp
        merged = parse_peer_list(p.address for p in (*self._static, *peers))
        if merged != self._peers and self._validate is not None:
            try:
                self._validate(merged)
            except ConfigError as exc:
                if force:
                    raise
                self.refused_reloads += 1
                log.error("kvengine: peer list %s refused (%s); keeping %d peers", self._path, exc, len(self._peers))
                return
        if merged != self._peers:
            log.info("kvengine: peer list %s now has %d peers", self._path, len(merged))
            self._peers = merged
            self.version += 1


class PeerHealth:
    """Cool-down bookkeeping: a failed peer is skipped until ``cooldown`` seconds pass."""

    def __init__(self, cooldown: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.cooldown = cooldown
        self._clock = clock
        self._down_until: dict[Peer, float] = {}

    def usable(self, peer: Peer) -> bool:
        until = self._down_until.get(peer)
        if until is None:
            return True
        if self._clock() >= until:
            del self._down_until[peer]  # half-open: the next request probes it
            return True
        return False

    def failed(self, peer: Peer) -> None:
        if peer not in self._down_until:
            log.warning("kvengine: peer %s failed; skipping it for %.1fs", peer.address, self.cooldown)
        self._down_until[peer] = self._clock() + self.cooldown

    def succeeded(self, peer: Peer) -> None:
        self._down_until.pop(peer, None)

    def down(self) -> list[Peer]:
        now = self._clock()
        return [p for p, until in self._down_until.items() if until > now]

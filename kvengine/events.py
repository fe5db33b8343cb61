"""KV cache events for KV-aware routers, in vLLM's wire format over a ZeroMQ PUB socket.

Routers such as llm-d's KV cache indexer and NVIDIA Dynamo's KV router keep an index of which
instance holds which KV blocks, fed by vLLM's KV cache events (``vllm/distributed/kv_events.py``).
kvengine publishes its own chunks in the same format, so such a router can index it too:

* :class:`BlockStored`: chunks entered a tier: memory (``medium="CPU"``, vLLM's name for host memory)
  when a store or a promotion commits them, a lower tier once a write to it succeeded (``"DISK"``,
  ``"PEERS"``, ``"MOONCAKE"``, else the transport's name in capitals; see :func:`medium_of`);
* :class:`BlockRemoved`: chunks left memory (evicted or dropped);
* :class:`AllBlocksCleared`: the engine closed: nothing it announced is served by it any more.

One block is one kvengine chunk: ``block_hashes`` are kvengine's chain hashes
(:func:`~kvengine.chunks.hashing.prefix_hashes`, seeded by the binding's namespace digest), which are
not vLLM's block hashes; each :class:`BlockStored` carries the chunks' token ids, from which a router
computes whatever hashes it matches prompts with.

Wire format (vLLM 0.32, byte for byte what its ``msgspec`` encoder writes for the same events): one
ZeroMQ multipart message per batch, ``(topic, seq, payload)``; ``seq`` is an 8-byte big-endian count
of batches from 0; ``payload`` is msgpack of ``EventBatch``, an array ``[ts, events,
data_parallel_rank]``. Each event is a map tagged by ``"type"`` (``"BlockStored"``, ...) followed by
the struct's fields in declaration order: required ones always (``lora_id`` and ``lora_name`` as nil
when unset), optional ones (``extra_keys``, ``group_idx``, ...) left out, as ``omit_defaults`` does.
Hashes go out as 16-byte msgpack ``bin`` (vLLM's ``ExternalBlockHash`` is ``bytes | int``), or, with
``hash_format="int64"``, as vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` writes them: the low 64
bits of the hash read big-endian, for routers that decode hashes as unsigned 64-bit integers.

Publishing never blocks or raises into the engine: :meth:`KVEventPublisher.publish` puts the event in
a bounded queue (full: dropped, counted); a background thread owns the socket, batches what is
queued, sends without blocking (a send that would block drops the batch, counted) and, with a replay
endpoint, answers replay requests as vLLM's ``ZmqEventPublisher`` does.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from kvengine.errors import ConfigError
from kvengine.threads import start_thread

if TYPE_CHECKING:
    from kvengine.config import EventsConfig

logger = logging.getLogger("kvengine")

#: A block hash on the wire: kvengine's 16-byte chain hash, or its 64-bit integer form (``hash_format``).
BlockHash = bytes | int
HashFormat = Literal["bytes", "int64"]

#: The memory tier's medium: vLLM's ``MEDIUM_CPU``.
MEDIUM_MEMORY = "CPU"
_MEDIA = {"memory": MEDIUM_MEMORY, "local_disk": "DISK", "mooncake": "MOONCAKE"}

#: The replay stream's last message carries this sequence number (vLLM's ``ZmqEventPublisher.END_SEQ``).
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_MASK64 = (1 << 64) - 1
_TOKEN_DTYPE = np.dtype("<u4")


def medium_of(tier: str) -> str:
    """The ``medium`` of a tier's events, from its transport's name: ``local_disk`` -> ``DISK``, any peer
    transport -> ``PEERS``, ``mooncake`` -> ``MOONCAKE``, others in capitals."""
    if tier in _MEDIA:
        return _MEDIA[tier]
    return "PEERS" if tier.startswith("peer") else tier.upper()


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive chunks of one prompt entered a tier.

    ``parent_block_hash`` is the hash of the chunk before the first (None: the prompt's first chunk).
    ``tokens`` holds the chunks' token ids as little-endian uint32 (as :func:`prefix_hashes` hashes
    them): compact, and turned into ``token_ids`` by the publisher's thread, not by the engine's.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    tokens: bytes
    block_size: int
    medium: str
    lora_name: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return np.frombuffer(self.tokens, dtype=_TOKEN_DTYPE).tolist()

    @property
    def full(self) -> bool:
        """Whether every chunk has ``block_size`` tokens (a trailing partial chunk has fewer)."""
        return len(self.tokens) == 4 * self.block_size * len(self.block_hashes)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Chunks left a tier."""

    block_hashes: tuple[BlockHash, ...]
    medium: str


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Everything the publisher announced is gone (vLLM's event carries no medium: it means every tier)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published message: events in order, stamped with the wall-clock time they were batched."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


@dataclass(frozen=True, slots=True)
class PublisherStats:
    """Counts since start: batches sent, events sent and dropped (queue full, socket would block), counted
    as published (before :func:`coalesce` merges runs)."""

    batches: int
    events: int
    dropped: int


# -- encoding -------------------------------------------------------------------------------------
def coalesce(events: Iterable[KVEvent]) -> list[KVEvent]:
    """The same events with runs merged, as vLLM batches blocks: a :class:`BlockStored` continuing the
    previous one's chain (same medium, block size and adapter, the previous one's chunks all full) joins
    it, and consecutive :class:`BlockRemoved` of one medium join. Order is kept."""
    groups: list[list[KVEvent]] = []
    for event in events:
        last = groups[-1][-1] if groups else None
        if isinstance(event, BlockStored) and isinstance(last, BlockStored):
            joins = (last.full and event.parent_block_hash == last.block_hashes[-1] and event.medium == last.medium
                     and event.block_size == last.block_size and event.lora_name == last.lora_name)
        elif isinstance(event, BlockRemoved) and isinstance(last, BlockRemoved):
            joins = event.medium == last.medium
        else:
            joins = False
        if joins:
            groups[-1].append(event)
        else:
            groups.append([event])
    return [group[0] if len(group) == 1 else _merge(group) for group in groups]


def _merge(group: list[KVEvent]) -> KVEvent:
    first = group[0]
    hashes = tuple(h for event in group for h in event.block_hashes)  # type: ignore[union-attr]
    if isinstance(first, BlockRemoved):
        return BlockRemoved(hashes, first.medium)
    assert isinstance(first, BlockStored)
    tokens = b"".join(event.tokens for event in group)  # type: ignore[union-attr]
    return BlockStored(hashes, first.parent_block_hash, tokens, first.block_size, first.medium, first.lora_name)


def _wire_hash(value: BlockHash, hash_format: HashFormat) -> BlockHash:
    if hash_format == "int64" and isinstance(value, bytes):
        return int.from_bytes(value, "big") & _MASK64
    return value


def _wire(event: KVEvent, hash_format: HashFormat) -> dict[str, Any]:
    """An event as msgspec encodes vLLM's struct of it: the tag, then the fields in declaration order."""
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        return {"type": "BlockStored",
                "block_hashes": [_wire_hash(h, hash_format) for h in event.block_hashes],
                "parent_block_hash": None if parent is None else _wire_hash(parent, hash_format),
                "token_ids": event.token_ids, "block_size": event.block_size, "lora_id": None,
                "medium": event.medium, "lora_name": event.lora_name}
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": [_wire_hash(h, hash_format) for h in event.block_hashes],
                "medium": event.medium}
    return {"type": "AllBlocksCleared"}


def encode_batch(batch: EventBatch, *, hash_format: HashFormat = "bytes") -> bytes:
    """The msgpack payload of ``batch``, as vLLM's ``msgspec`` encoder writes its ``KVEventBatch``."""
    import msgpack

    events = [_wire(event, hash_format) for event in batch.events]
    return msgpack.packb([batch.ts, events, batch.data_parallel_rank], use_bin_type=True)


def decode_batch(payload: bytes) -> EventBatch:
    """A payload of vLLM's format (kvengine's or vLLM's own); events of other types are skipped, fields
    kvengine does not use (``extra_keys``, ``group_idx``, ...) ignored."""
    import msgpack

    fields = msgpack.unpackb(payload, raw=False)
    events: list[KVEvent] = []
    for item in fields[1]:
        kind = item.get("type")
        if kind == "BlockStored":
            parent = item["parent_block_hash"]
            events.append(BlockStored(tuple(item["block_hashes"]), parent,
                                      np.asarray(item["token_ids"], dtype=_TOKEN_DTYPE).tobytes(),
                                      item["block_size"], item.get("medium") or "", item.get("lora_name")))
        elif kind == "BlockRemoved":
            events.append(BlockRemoved(tuple(item["block_hashes"]), item.get("medium") or ""))
        elif kind == "AllBlocksCleared":
            events.append(AllBlocksCleared())
    return EventBatch(fields[0], tuple(events), fields[2] if len(fields) > 2 else None)


# -- publishing -----------------------------------------------------------------------------------
#: The publishing thread wakes this often when idle (to see close() and replay requests).
_POLL_SECONDS = 0.1
#: Events per batch at most (a batch is what was queued when the thread took it).
_MAX_BATCH = 512
#: How long closing the socket waits for queued messages to reach connected subscribers.
_LINGER_MS = 200


def _binds(endpoint: str, bind: bool | None) -> bool:
    """vLLM's rule unless told: wildcard hosts, ``ipc://`` and ``inproc://`` bind; other addresses connect
    (to a router that binds, as llm-d's indexer does)."""
    if bind is not None:
        return bind
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """Publishes :data:`KVEvent`\\ s on a ZeroMQ PUB socket in vLLM's format; never blocks its callers.

    :meth:`publish` is thread-safe and constant-time (a bounded queue; full: the event is dropped and
    counted). :meth:`start` opens the socket and starts the thread that owns it: it takes what is
    queued as one batch (runs merged, :func:`coalesce`), numbers it, sends it without blocking and
    keeps it for replay when a replay endpoint is set. :meth:`close` sends what is left and stops.
    """

    def __init__(self, endpoint: str, *, topic: str = "", bind: bool | None = None,
                 replay_endpoint: str | None = None, buffer_steps: int = 1000, queue_size: int = 10_000,
                 data_parallel_rank: int | None = 0, hash_format: HashFormat = "bytes") -> None:
        #: Where the socket is bound or connected (after :meth:`start`, the bound address: a port 0 resolved).
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self._topic = topic.encode()
        self._binds = _binds(endpoint, bind)
        self._buffer: deque[tuple[int, bytes]] | None = deque(maxlen=buffer_steps) if replay_endpoint else None
        self._queue: queue.Queue[KVEvent] = queue.Queue(maxsize=queue_size)
        self._hwm = queue_size
        self._rank = data_parallel_rank
        self._hash_format: HashFormat = hash_format
        self._seq = 0
        self._batches = self._events = self._dropped = 0
        self._drop_lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self._warned = False
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, config: EventsConfig) -> KVEventPublisher | None:
        """The publisher ``config`` asks for; None when events are off (no endpoint)."""
        if config.endpoint is None:
            return None
        return cls(config.endpoint, topic=config.topic, bind=config.bind, replay_endpoint=config.replay_endpoint,
                   buffer_steps=config.buffer_steps, queue_size=config.queue_size,
                   data_parallel_rank=config.data_parallel_rank, hash_format=config.hash_format)

    # -- any thread ---------------------------------------------------------------------------------
    def publish(self, event: KVEvent) -> None:
        """Queue ``event`` for sending; never blocks, never raises (full or closed: dropped, counted)."""
        if self._closed:
            self._drop(1)
            return
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self._drop(1)

    def stats(self) -> PublisherStats:
        return PublisherStats(self._batches, self._events, self._dropped)

    def _drop(self, n: int) -> None:
        """Count dropped events (no I/O: callers may hold the memory tier's lock; the thread logs)."""
        with self._drop_lock:
            self._dropped += n

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Bind or connect the socket(s) and start the publishing thread.

        :raises ConfigError: pyzmq or msgpack missing, or the endpoint cannot be bound or connected.
        """
        if self._thread is not None:
            return
        try:
            import msgpack  # noqa: F401  (the thread encodes with it)
            import zmq
        except ImportError as exc:
            raise ConfigError(f"events.endpoint needs pyzmq and msgpack ({exc}): pip install 'kvengine[events]'") \
                from None
        ctx = zmq.Context()
        opening = self.endpoint
        try:
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self._hwm)
            pub.setsockopt(zmq.LINGER, _LINGER_MS)
            if self._binds:
                pub.bind(self.endpoint)
                self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                pub.connect(self.endpoint)
            replay = None
            if self.replay_endpoint is not None:
                opening = self.replay_endpoint
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self.replay_endpoint)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            ctx.destroy(linger=0)
            raise ConfigError(f"events: cannot open {opening!r}: {exc}") from None
        self._thread = start_thread(self._run, "kvengine-events", ctx, pub, replay)
        logger.info("kvengine: publishing KV events on %s (%s)%s", self.endpoint,
                    "bound" if self._binds else "connected",
                    f", replay on {self.replay_endpoint}" if self.replay_endpoint else "")

    def close(self, timeout: float = 2.0) -> None:
        """Stop taking events, send what is queued (for at most ``timeout`` seconds), close. Idempotent."""
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the publishing thread ------------------------------------------------------------------------
    def _run(self, ctx: Any, pub: Any, replay: Any) -> None:
        import zmq

        try:
            while True:
                try:
                    first = self._queue.get(timeout=_POLL_SECONDS)
                except queue.Empty:
                    first = None
                if replay is not None:
                    self._serve_replay(replay, zmq)
                if self._dropped and not self._warned:
                    self._warned = True
                    logger.warning("kvengine: KV events dropped (queue full or subscribers not keeping up): "
                                   "routers may see a stale index; counted in the publisher's stats()")
                if first is None:
                    if self._stop.is_set():
                        return
                    continue
                batch = [first]
                while len(batch) < _MAX_BATCH:
                    try:
                        batch.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                self._send(pub, batch, zmq)
        finally:
            ctx.destroy(linger=_LINGER_MS)

    def _send(self, pub: Any, batch: list[KVEvent], zmq: Any) -> None:
        try:
            payload = encode_batch(EventBatch(time.time(), tuple(coalesce(batch)), self._rank),
                                   hash_format=self._hash_format)
        except Exception as exc:  # a bug, never the engine's problem: counted, logged once
            self._drop(len(batch))
            logger.error("kvengine: encoding KV events failed (%s: %s)", type(exc).__name__, exc)
            return
        seq = self._seq
        self._seq += 1
        if self._buffer is not None:
            self._buffer.append((seq, payload))
        try:
            pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # would block (or the socket failed): the batch is lost to live subscribers
            self._drop(len(batch))
            return
        self._batches += 1
        self._events += len(batch)

    def _serve_replay(self, replay: Any, zmq: Any) -> None:
        """Answer replay requests ``(identity, b"", start seq)`` with every kept batch from ``start`` on,
        then an end marker, as vLLM's ``ZmqEventPublisher`` does."""
        assert self._buffer is not None
        try:
            while replay.poll(0):
                frames = replay.recv_multipart(zmq.NOBLOCK)
                if len(frames) != 3:
                    continue
                client, _, start = frames
                start_seq = int.from_bytes(start, "big")
                for seq, payload in list(self._buffer):
                    if seq >= start_seq:
                        replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload),
                                              flags=zmq.NOBLOCK)
                replay.send_multipart((client, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("kvengine: KV event replay failed (%s)", exc)


__all__ = ["AllBlocksCleared", "BlockHash", "BlockRemoved", "BlockStored", "EventBatch", "KVEvent",
           "KVEventPublisher", "MEDIUM_MEMORY", "PublisherStats", "coalesce", "decode_batch", "encode_batch",
           "medium_of"]

"""Prefill/decode disaggregation: a producer instance hands each prompt's KV to a consumer instance.

Roles (vLLM's ``kv_role``):

* ``kv_producer`` (prefill): stores every chunk of the prompt as a ``kv_both``
  instance does, and, once the prompt is computed, its **tail**: the pages of
  the last, partial chunk up to the prompt's last token (the consumer computes
  that token). The tail is a keyed record (:data:`TAIL_SCHEME`) in the same
  tiers, record format and verification as the chunks. The producer then
  *holds* the prompt's chunks (a reservation, so memory pressure cannot evict
  them) until a consumer fetches the tail, or the engine's lease
  (``kvengine.lease_seconds``) expires; and its worker serves its memory tier
  to consumers over the peer wire (``handoff.listen``). vLLM returns
  :class:`HandoffParams` in the finished request's ``kv_transfer_params``.
* ``kv_consumer`` (decode): given those params, looks the prompt up through its
  peer tier (the producers are its ``peers``), asking the producer the params
  name first (:meth:`PromptTails.reads`), tail included, and loads all of it
  into its pages: it computes only the prompt's last token. Any fault (the
  producer gone, the lease expired, a record that does not verify) is a
  shorter hit or a miss: vLLM computes the rest, exactly.

Through a Mooncake Store instead (a producer with no ``handoff.listen``, both
instances with a ``kvengine.mooncake`` tier): the producer's records reach the
store as its other chunks do, no hold and no server; the params name
:data:`VIA_MOONCAKE`, and the consumer asks its tiers for the prompt until all
of it is there (the writes may still be under way) or ``handoff.fetch_timeout``
ends.

A consumer accepts params only from a producer in its ``peers`` list (or
naming Mooncake, where it has that tier) and in its own namespace (the same model, weights, dtype, KV layout and tensor
split): others are refused with the reason, counted, and computed locally.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvengine.addresses import offset_port, split_host_port
from kvengine.chunks.hashing import prefix_end_hash
from kvengine.chunks.keys import ChunkKey
from kvengine.config import EngineConfig
from kvengine.errors import ConfigError, InvalidRequestError
from kvengine.facade import KVEngine
from kvengine.keyed import SyncKeyedStore, keyed_chunk_key, keyed_namespace
from kvengine.lookups import LookupResult
from kvengine.sharing import EngineServer, WireOptions, WireSettingNames
from kvengine.transport import Buffer, ReadScope
from kvengine.types import ModelBinding

from .layout import BlockIds, PagedLayout
from .options import HandoffOptions
from .paging import PagedCopier

if TYPE_CHECKING:
    from kvengine.config import PeersConfig
    from kvengine.transports.peers.store import RecordStore

logger = logging.getLogger("vllm.kvengine")

class Role(enum.Enum):
    """vLLM's ``kv_role``, as the connector plays it."""

    BOTH = "kv_both"  # a cache: looks up and stores every request (the default)
    PRODUCER = "kv_producer"  # prefill: hands each computed prompt off to a consumer
    CONSUMER = "kv_consumer"  # decode: loads handed-off prompts; stores nothing


#: Key scheme of the prompt tails' namespace (see :func:`kvengine.keyed.keyed_namespace`).
TAIL_SCHEME = "vllm-prompt-tail"
#: The entry of vLLM's ``kv_transfer_params`` that carries :class:`HandoffParams`.
PARAMS_KEY = "kvengine_handoff"
#: :attr:`HandoffParams.producer` of a prompt handed off through the Mooncake Store both instances use
#: (a producer with no ``handoff.listen``): no server to dial; the consumer waits for the records there.
VIA_MOONCAKE = "mooncake"


@dataclass(frozen=True, slots=True)
class HandoffParams:
    """What a consumer needs to load a prompt a producer computed (in ``kv_transfer_params``)."""

    #: ``host:port`` of the producer's handoff server (one of the consumer's ``peers``), or
    #: :data:`VIA_MOONCAKE`
    producer: str
    #: tokens whose KV the producer stored: the prompt less its last token
    tokens: int
    #: hex digest of the producer's namespace (model, weights, dtype, layout, tensor split)
    namespace: str

    def to_transfer_params(self) -> dict[str, Any]:
        return {PARAMS_KEY: {"producer": self.producer, "tokens": self.tokens, "namespace": self.namespace}}

    @classmethod
    def from_transfer_params(cls, params: Mapping[str, Any] | None) -> HandoffParams | None:
        """The params in a request's ``kv_transfer_params`` (None: none given).

        :raises InvalidRequestError: naming the field that is missing or ill-typed.
        """
        if not params or PARAMS_KEY not in params:
            return None
        raw = params[PARAMS_KEY]
        if not isinstance(raw, Mapping):
            raise InvalidRequestError(f"kv_transfer_params[{PARAMS_KEY!r}] must be a mapping, got {type(raw).__name__}")
        producer, tokens, namespace = raw.get("producer"), raw.get("tokens"), raw.get("namespace")
        try:
            if not isinstance(producer, str):
                raise ConfigError(f"got {producer!r}")
            if producer != VIA_MOONCAKE:
                split_host_port(producer, any_port=False)  # the address a consumer dials
        except ConfigError as exc:
            raise InvalidRequestError(f"kv_transfer_params[{PARAMS_KEY!r}].producer must be 'host:port' or "
                                      f"{VIA_MOONCAKE!r}: {exc}") from None
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise InvalidRequestError(f"kv_transfer_params[{PARAMS_KEY!r}].tokens must be a count, got {tokens!r}")
        if not isinstance(namespace, str) or not namespace:
            raise InvalidRequestError(f"kv_transfer_params[{PARAMS_KEY!r}].namespace must be a digest, "
                                      f"got {namespace!r}")
        return cls(producer, tokens, namespace)


def handoff_sources(config: EngineConfig) -> frozenset[str]:
    """Where a consumer with this engine configuration may load handed-off prompts from: its ``peers``, and
    :data:`VIA_MOONCAKE` where it has a Mooncake tier."""
    return frozenset(config.peers.peers) | (frozenset({VIA_MOONCAKE}) if config.mooncake.master else frozenset())


@dataclass(frozen=True, slots=True)
class PromptTail:
    """The pages of a prompt's last, partial chunk: tokens ``[start, end)`` (a copy, the holder's)."""

    start: int
    end: int
    tensors: tuple[torch.Tensor, ...]


class PromptTails:
    """Store and find prompt tails (see the module docs), keyed by the chained hash of all ``end`` tokens."""

    def __init__(self, engine: KVEngine, layout: PagedLayout, copier: PagedCopier, fetch_timeout: float,
                 rank: int = 0) -> None:
        self.engine = engine
        #: seconds a consumer's reads of a handed-off prompt's chunks, then of its tail, may take
        self.fetch_timeout = fetch_timeout
        #: this tensor-parallel rank: it reads its shard from the producer's rank ``rank`` (its port + rank)
        self._rank = rank
        self._layout = layout.chunk
        self._chunk = layout.chunk.chunk_size
        self._copier = copier
        self._stores: dict[bytes, SyncKeyedStore] = {}
        self._lock = threading.Lock()

    @property
    def chunk_size(self) -> int:
        return self._chunk

    def binding(self, binding: ModelBinding) -> ModelBinding:
        """The tails' binding beside the chunks' ``binding``."""
        return self._store(binding).binding

    def _store(self, binding: ModelBinding) -> SyncKeyedStore:
        with self._lock:
            store = self._stores.get(binding.digest)
            if store is None:
                keyed = self.engine.bind(keyed_namespace(binding.namespace, TAIL_SCHEME), self._layout)
                store = self._stores[binding.digest] = SyncKeyedStore(self.engine, keyed)
        return store

    def key(self, binding: ModelBinding, tokens: np.ndarray, end: int) -> bytes:
        return bytes(prefix_end_hash(tokens, self._chunk, binding.digest, end))

    def last_key(self, binding: ModelBinding, tokens: np.ndarray, end: int) -> ChunkKey:
        """The address (in the engine and on the peer wire) of the record a consumer of ``tokens[:end]``
        fetches last: the tail, or the last chunk where ``end`` is a chunk boundary."""
        if end % self._chunk:
            return keyed_chunk_key(self.binding(binding), self.key(binding, tokens, end))
        return ChunkKey(binding.digest, prefix_end_hash(tokens, self._chunk, binding.digest, end))

    def save(self, binding: ModelBinding, tokens: np.ndarray, end: int, block_ids: BlockIds, null: int) -> bool:
        """Store the pages of tokens ``[end // chunk * chunk, end)`` held in ``block_ids``."""
        start = end // self._chunk * self._chunk
        tensors = [torch.empty(t.shape, dtype=t.dtype, device=self._copier.device(i))
                   for i, t in enumerate(self._layout.tensors)]
        for i, out in enumerate(tensors):
            self._copier.gather_into(i, start, block_ids, null, out, end=end)
        return self._store(binding).put([self.key(binding, tokens, end)], lambda _i: tensors)[0].ok

    def reads(self, producer: str, budget: float | None = None) -> ReadScope:
        """How a handed-off prompt is read: from ``producer`` first (through the tiers where it is
        :data:`VIA_MOONCAKE`), within ``budget`` (default ``fetch_timeout``)."""
        return ReadScope(budget=self.fetch_timeout if budget is None else budget,
                         source=None if producer == VIA_MOONCAKE else offset_port(producer, self._rank))

    def find(self, binding: ModelBinding, tokens: np.ndarray, end: int, reads: ReadScope | None) -> PromptTail | None:
        """A copy of the tail of ``tokens[:end]`` (None: not stored here nor in a tier below), read as
        ``reads`` says (:meth:`reads`)."""
        got: list[tuple[torch.Tensor, ...]] = []

        def keep(_i: int, tensors: Sequence[torch.Tensor]) -> None:
            got.append(tuple(t.clone() for t in tensors))

        if not self._store(binding).get([self.key(binding, tokens, end)], keep, reads=reads)[0].ok:
            return None
        return PromptTail(end // self._chunk * self._chunk, end, got[0])


class HandoffHolds:
    """The producer's holds on handed-off prompts, by the key of the record a consumer fetches last.

    A hold is a reservation of the prompt's chunks (pinned against eviction). Fetching that record ends it
    (:meth:`confirm`); else the engine's lease reclaims it, and :meth:`sweep` forgets it (counted expired).
    Thread-safe: the worker holds, the handoff server's thread confirms.
    """

    def __init__(self, engine: KVEngine, lease_s: float, count: Callable[[str], None] = lambda event: None) -> None:
        self.engine = engine
        self._lease = lease_s
        self._count = count  # "hold_confirmed", "hold_expired"
        self._held: dict[ChunkKey, tuple[LookupResult, float]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def hold(self, last: ChunkKey, binding: ModelBinding, request_id: str, tokens: np.ndarray, full: int) -> None:
        """Pin the ``full`` tokens' chunks of ``tokens`` until ``last`` is fetched or the lease ends (a prompt
        shorter than a chunk has none: its tail is one record, the most recently used)."""
        self.sweep()
        res = self.engine.lookup(binding, f"handoff:{request_id}", tokens[:full], max_tokens=full) if full else None
        with self._lock:
            old = self._held.pop(last, None)
            if res is not None:
                self._held[last] = (res, time.monotonic() + self._lease)
        if old is not None:
            self.engine.release(old[0])

    def confirm(self, keys: Sequence[ChunkKey]) -> None:
        """The consumer fetched ``keys``: release the holds they end."""
        now = time.monotonic()
        with self._lock:
            ended = [held for k in keys if (held := self._held.pop(k, None)) is not None]
        for res, until in ended:
            self.engine.release(res)  # a no-op where the lease already reclaimed it
            self._count("hold_confirmed" if until > now else "hold_expired")

    def sweep(self) -> None:
        """Forget holds past their lease (the engine has reclaimed their pins)."""
        now = time.monotonic()
        with self._lock:
            gone = [k for k, (_, until) in self._held.items() if until <= now]
            ended = [self._held.pop(k) for k in gone]
        for res, _ in ended:
            self.engine.release(res)  # a no-op where the lease already reclaimed it
            self._count("hold_expired")

    def release_all(self) -> None:
        with self._lock:
            ended, self._held = list(self._held.values()), {}
        for res, _ in ended:
            self.engine.release(res)


class HandoffStore:
    """The producer's memory tier as a peer store (:class:`~kvengine.sharing.EngineStore`) whose reads end the
    holds they complete."""

    def __init__(self, inner: RecordStore, holds: HandoffHolds) -> None:
        self._inner = inner
        self._holds = holds

    async def get(self, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
        out = await self._inner.get(keys)
        self._holds.confirm([k for k, record in zip(keys, out) if record is not None])
        return out

    async def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return await self._inner.exists(keys)

    async def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        return [False] * len(items)  # a producer serves what it computed; it takes nothing from peers

    async def delete(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [False] * len(keys)


class HandoffServer:
    """A producer's server for consumers: its memory tier over the peer wire its ``peers.transport`` names
    (the consumers' wire: tcp, TLS with ``handoff.tls_cert``; zmq, CURVE with ``handoff.curve_allow``; ucx),
    records sealed with ``peers.secret_file``, reads ending holds."""

    def __init__(self, server: EngineServer, holds: HandoffHolds, address: str) -> None:
        self._server = server
        self.holds = holds
        #: as consumers dial it
        self.address = address

    @classmethod
    def start(cls, engine: KVEngine, options: HandoffOptions, events: Any) -> HandoffServer:
        """Serve on ``options.listen``; ``events``: a Prometheus counter labelled ``event``.

        :raises ConfigError: no ``listen`` address, off loopback without protection, another wire's options,
            or a bad TLS file or CURVE key (each named by its setting).
        """
        from kvengine.trust.secrets import read_secret_file

        if options.listen is None:
            raise ConfigError("kvengine vLLM connector: kv_role 'kv_producer' needs kv_connector_extra_config "
                              "handoff.listen ('host:port' where decode instances fetch the prompts' KV)")
        secret = read_secret_file(engine.config.peers.secret_file, "peers.secret_file")
        holds = HandoffHolds(engine, float(engine.config.lease_seconds),
                             lambda event: events.labels(event=event).inc())
        server = EngineServer(engine, options.listen, _wire(options, engine.config.peers), secret=secret,
                              names=HANDOFF_SETTINGS, wrap=lambda store: HandoffStore(store, holds))
        bound = server.start()
        logger.info("kvengine: handoff server for decode instances on %s (%s)", bound, engine.config.peers.transport)
        return cls(server, holds, options.advertise or bound)

    def share(self, *bindings: ModelBinding) -> None:
        """Serve these namespaces' chunks (a binding is shared once it hands off a prompt)."""
        self._server.share(*bindings)

    def stop(self) -> None:
        self._server.stop()
        self.holds.release_all()


#: A producer's names of its handoff server's settings (its wire is the consumers': ``peers.transport``).
HANDOFF_SETTINGS = WireSettingNames(
    bind="handoff.listen", transport="this producer's peers.transport", secret="peers.secret_file",
    tls="handoff.tls_cert/tls_key", curve_keys="peers.curve_public_key/curve_secret_key",
    curve_allow="handoff.curve_allow (the consumers' CURVE public keys)")


def _wire(options: HandoffOptions, peers: PeersConfig) -> WireOptions:
    """The producer's wire: its ``peers.transport``, with every handoff security setting given (the server
    refuses another wire's, naming them: :data:`HANDOFF_SETTINGS`); CURVE with this producer's keys where
    consumers are listed. :raises ConfigError: consumers listed without the producer's keys."""
    curve: dict[str, Any] = {}
    if options.curve_allow:
        curve["curve_allow"] = frozenset(k.encode() for k in options.curve_allow)
        if peers.transport == "zmq":
            if not (peers.curve_public_key and peers.curve_secret_key):
                raise ConfigError("handoff.curve_allow needs this producer's CURVE keys: peers.curve_public_key "
                                  "and peers.curve_secret_key (consumers set its public key as "
                                  "peers.curve_server_key)")
            curve.update(curve_public_key=peers.curve_public_key.encode(),
                         curve_secret_key=peers.curve_secret_key.encode())
    return WireOptions(transport=peers.transport, tls_cert=options.tls_cert, tls_key=options.tls_key, **curve)

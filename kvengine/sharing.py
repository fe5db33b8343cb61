"""What a node shares with its peers: its engine's memory tier, served over a peer wire.

The peer wires (:mod:`kvengine.transports`) serve any :class:`~kvengine.transports.peers.store.RecordStore`
and know nothing of the engine. This module sits above both:

* :class:`EngineStore` -- a running engine's memory tier as a record store (chunks of the namespaces it
  was told to share, encoded into records on demand, exactly as the engine writes them to its own tiers),
  in front of a backing store that keeps what other nodes put.
* :class:`WireOptions` and :func:`peer_server` -- the one place a wire's name becomes its server, with
  that wire's security (TLS on tcp, CURVE on zmq, none on ucx) and the loopback rules, refused in the
  caller's own words (:class:`WireSettingNames`: a config key or a command-line flag).
* :class:`EngineServer` -- an engine's memory tier served on a wire from a thread of its own (what the
  vLLM handoff runs on a producer).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from kvengine.addresses import is_loopback, split_host_port
from kvengine.chunks.keys import ChunkKey, NamespaceDigest
from kvengine.chunks.record import seal_record
from kvengine.compression import codec_family
from kvengine.config import MIN_MEMORY_BYTES
from kvengine.core.engine import CacheEngine
from kvengine.errors import ConfigError, InvalidRequestError
from kvengine.facade import KVEngine, engine_of
from kvengine.transport import Buffer
from kvengine.types import ModelBinding

if TYPE_CHECKING:
    from kvengine.transports.peers.service import PeerServer, ServerOptions
    from kvengine.transports.peers.store import RecordStore

Wire = Literal["tcp", "zmq", "ucx"]


class EngineStore:
    """A :class:`CacheEngine`'s memory tier in front of ``backing``.

    ``get`` / ``exists`` look in the engine's memory first, for namespaces
    passed to :meth:`share` only (a chunk is encoded with the binding's
    codec and verification flag, exactly as the engine's tier writer does),
    then in ``backing``. ``put`` and ``delete`` go to ``backing`` only: the
    memory tier holds what this node computed; what peers send is kept
    apart. Safe to use from another thread's event loop than the engine's
    (memory-tier pins are thread-safe; encoding runs in a worker thread).
    """

    name = "peer_engine"

    def __init__(self, engine: CacheEngine, backing: RecordStore, bindings: Iterable[ModelBinding] = (),
                 *, secret: bytes | None = None) -> None:
        self.engine = engine
        self.backing = backing
        #: the peer group's secret: records encoded from memory are sealed with it (readers require it)
        self._secret = secret
        self._bindings: dict[NamespaceDigest, ModelBinding] = {}
        for binding in bindings:
            self.share(binding)

    def share(self, binding: ModelBinding) -> None:
        """Serve this binding's chunks from the engine's memory tier.

        :raises InvalidRequestError: if the engine's ``peers.codec`` would
            serve this namespace KV of another codec family (e.g. lossy KV
            to exact readers).
        """
        family = codec_family(self.engine.peer_codec)
        if binding.namespace.codec_family != family:
            raise InvalidRequestError(
                f"peers.codec {self.engine.peer_codec.name!r} is of family {family!r} but the namespace "
                f"of model {binding.namespace.model!r} asks for {binding.namespace.codec_family!r}"
            )
        self._bindings[binding.digest] = binding

    async def get(self, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
        out: list[Buffer | None] = list(await asyncio.to_thread(self._encode_resident, keys))
        missing = [i for i, record in enumerate(out) if record is None]
        if missing:
            for i, record in zip(missing, await self.backing.get([keys[i] for i in missing])):
                out[i] = record
        return out

    async def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        out = [k.namespace in self._bindings and self.engine.holds(k) for k in keys]
        missing = [i for i, ok in enumerate(out) if not ok]
        if missing:
            for i, ok in zip(missing, await self.backing.exists([keys[i] for i in missing])):
                out[i] = ok
        return out

    async def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        return await self.backing.put(items)

    async def delete(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return await self.backing.delete(keys)

    def _encode_resident(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            binding = self._bindings.get(key.namespace)
            record = None if binding is None else self.engine.resident_record(binding, key)
            if record is not None and self._secret is not None:
                record = seal_record(record, self._secret)
            out.append(record)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class WireOptions:
    """A peer server's wire and that wire's own security settings (each caller checks its settings' names)."""

    transport: Wire = "tcp"
    #: tcp: TLS with this certificate and key; ``tls_ca`` admits only clients with a certificate it signed
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    #: tcp: a message's bytes must all arrive within this many seconds once it started (None: the default)
    message_timeout: float | None = None
    #: zmq: CURVE with this server keypair (Z85), admitting ``curve_allow`` (None: any client with the key)
    curve_public_key: bytes | None = None
    curve_secret_key: bytes | None = None
    curve_allow: frozenset[bytes] | None = None

    @property
    def encrypted(self) -> bool:
        return self.tls_cert is not None or self.curve_secret_key is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class WireSettingNames:
    """What the caller calls a peer server's settings (config keys, or a command's flags), so that a refusal
    names what its user must change."""

    bind: str
    transport: str
    secret: str
    #: the tcp wire's TLS files (certificate, key, CA)
    tls: str
    #: the zmq wire's server keypair, and the clients it admits
    curve_keys: str
    curve_allow: str


def peer_server(store: RecordStore, bind: str, served: ServerOptions, wire: WireOptions, *,
                names: WireSettingNames) -> PeerServer:
    """``store`` served on ``bind`` over ``wire`` (not started).

    :raises ConfigError: naming the caller's setting (``names``): another wire's security settings, ``bind``
        off loopback with neither ``served.secret`` nor an encrypted wire, a zmq server off loopback that
        does not admit only listed clients, or TLS files that do not load.
    """
    from kvengine.transports.peers.client import require_protection

    if wire.transport != "tcp" and (wire.tls_cert or wire.tls_key or wire.tls_ca):
        raise ConfigError(f"{names.tls} are settings of the tcp wire; {names.transport} is {wire.transport!r}")
    if wire.transport != "tcp" and wire.message_timeout:
        raise ConfigError(f"a message timeout is a setting of the tcp wire; {names.transport} is "
                          f"{wire.transport!r}")
    if wire.transport != "zmq" and (wire.curve_secret_key or wire.curve_allow):
        raise ConfigError(f"{names.curve_keys} and {names.curve_allow} are settings of the zmq wire; "
                          f"{names.transport} is {wire.transport!r}")
    if (wire.tls_key or wire.tls_ca) and wire.tls_cert is None:
        raise ConfigError(f"{names.tls}: a TLS key or CA needs the server's certificate")
    if wire.curve_secret_key is not None and wire.curve_public_key is None:
        raise ConfigError(f"{names.curve_keys}: CURVE needs the server's public key with its secret key")
    if wire.transport == "zmq" and wire.curve_allow is None and not is_loopback(split_host_port(bind)[0]):
        # libzmq buffers a message whole before kvengine sees it: only listed clients may connect, secret or not
        raise ConfigError(f"{names.bind} {bind} is off loopback: on the zmq wire a server admits only listed "
                          f"clients ({names.curve_allow}, with {names.curve_keys}), or use the tcp wire")
    require_protection([bind], secret=served.secret, encrypted=wire.encrypted, what=names.bind,
                       remedy=f"Set {names.secret} (records authenticated with a keyed MAC; required for UCX), or "
                              f"encrypt the wire ({names.tls} on tcp, {names.curve_keys} on zmq)")
    if wire.transport == "tcp":
        from kvengine.transports.peers.tcp import TcpPeerServer, TcpServerOptions, TlsConfig

        tls = None
        if wire.tls_cert is not None:
            tls = TlsConfig(cert=wire.tls_cert, key=wire.tls_key, ca=wire.tls_ca)
            tls.server_context()  # the files load now, or the caller hears which do not
        timeout = {} if wire.message_timeout is None else {"message_timeout": wire.message_timeout}
        return TcpPeerServer(store, bind, served, TcpServerOptions(tls=tls, **timeout))
    if wire.transport == "ucx":
        from kvengine.transports.peers.ucx import UcxPeerServer

        return UcxPeerServer(store, bind, served)
    from kvengine.transports.peers.zmq import CurveConfig, ZmqOptions, ZmqPeerServer

    curve = None
    if wire.curve_secret_key is not None:
        assert wire.curve_public_key is not None
        curve = CurveConfig(public_key=wire.curve_public_key, secret_key=wire.curve_secret_key,
                            allowed_clients=wire.curve_allow)
    return ZmqPeerServer(store, bind, served, ZmqOptions(curve=curve))


class EngineServer:
    """``engine``'s memory tier (:class:`EngineStore`, records sealed with ``secret``) served to peers on
    ``listen`` from a thread of its own; ``wrap`` may put a store of the caller's in front of it. Puts from
    peers go to a small memory store of their own (``backing_bytes``)."""

    def __init__(self, engine: KVEngine, listen: str, wire: WireOptions, *, secret: bytes | None,
                 names: WireSettingNames,
                 wrap: Callable[[RecordStore], RecordStore] = lambda store: store,
                 backing_bytes: int = MIN_MEMORY_BYTES) -> None:
        from kvengine.transports.peers.service import ServerOptions, ServerThread
        from kvengine.transports.peers.store import MemoryRecordStore

        self._store = EngineStore(engine_of(engine), MemoryRecordStore(backing_bytes), secret=secret)
        server = peer_server(wrap(self._store), listen, ServerOptions(secret=secret), wire, names=names)
        self._thread = ServerThread(server)
        #: the ``host:port`` bound, once :meth:`start` returned
        self.address = ""

    def start(self) -> str:
        """Serve; returns the ``host:port`` bound. Raises what the wire's server raises on start."""
        self.address = self._thread.start()
        return self.address

    def share(self, *bindings: ModelBinding) -> None:
        """Serve these namespaces' chunks."""
        for binding in bindings:
            self._store.share(binding)

    def stop(self) -> None:
        self._thread.stop()

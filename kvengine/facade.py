"""A thread-safe synchronous facade for inference engines.

:class:`KVEngine` runs a :class:`CacheEngine` on a private event loop in a
background thread. Its methods may be called from any number of threads
(never from that loop's own thread); each call costs one thread hop, so the
API is batched per request, not per chunk.

After :meth:`KVEngine.close` every method raises :class:`EngineClosedError`
(``close`` itself is idempotent); the check comes before anything is sent to
the (stopped) loop, so no coroutine is left unawaited.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from kvengine.chunks.codecs import Codec, CodecRegistry
from kvengine.chunks.hashing import TokenInput
from kvengine.chunks.keys import Namespace
from kvengine.chunks.layout import ChunkLayout
from kvengine.config import EngineConfig, load_config
from kvengine.core.caller_mode import in_callers_mode
from kvengine.core.engine import CacheEngine
from kvengine.core.staging import StagedStore
from kvengine.errors import CLOSED_MESSAGE, EngineClosedError, KVEngineError
from kvengine.events import KVEventPublisher
from kvengine.lookups import LookupResult
from kvengine.metrics import EngineMetrics
from kvengine.threads import start_thread
from kvengine.tiers import Tier, build_tiers
from kvengine.transport import ChunkTransport, ReadScope
from kvengine.types import ChunkSink, ChunkSource, ChunkView, LoadResult, ModelBinding, StoreResult

T = TypeVar("T")


class _Escaped:
    """A BaseException that must not unwind the engine's loop, carried to the calling thread."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


async def _contained(coro: Coroutine[Any, Any, T]) -> T | _Escaped:
    # asyncio re-raises KeyboardInterrupt / SystemExit out of the event loop, which would kill the
    # loop thread and leave this and every later call waiting forever.
    try:
        return await coro
    except (KeyboardInterrupt, SystemExit) as exc:
        return _Escaped(exc)


class KVEngine:
    """Embedded cache engine with a blocking API.

    ``config`` may be an :class:`EngineConfig` (final, as :func:`load_config` resolved it), a dict,
    a YAML path or None (defaults, or the file ``KVENGINE_CONFIG_FILE`` names); ``KVENGINE_*``
    environment variables override a dict or file.
    ``transports`` replaces the tiers the configuration would build (a bare
    transport writes records with ``disk.codec``).
    """

    def __init__(
        self,
        config: EngineConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
        *,
        transports: Sequence[ChunkTransport | Tier] | None = None,
        codecs: CodecRegistry | None = None,
    ) -> None:
        self.config = load_config(config)
        self._closed = False
        self._submit_lock = threading.Lock()
        self._loop_stopping = False
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = start_thread(self._loop.run_forever, "kvengine-loop")
        try:
            if transports is None:
                transports = build_tiers(self.config)
            self._core = CacheEngine(self.config, transports=transports, codecs=codecs)
            self._stop_metrics: Callable[[], None] | None = None
            self.run(self._core.start())
            if self.config.metrics_port is not None:
                try:
                    self._stop_metrics = self._core.metrics.serve_http(self.config.metrics_port,
                                                                      self.config.metrics_host)
                except BaseException:
                    self.run(self._core.close(flush=False))
                    raise
        except BaseException:
            self._stop_loop()
            raise

    # -- plumbing -------------------------------------------------------------
    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine of the engine (:func:`engine_of`; an extension's such as :mod:`kvengine.keyed`) and wait.

        A ``BaseException`` raised inside (``KeyboardInterrupt``, ``SystemExit`` from a caller's sink or
        source) reaches the caller here, in its own thread; the engine's loop keeps running.

        :raises EngineClosedError: after :meth:`close` (``coro`` is closed, never run).
        """
        if self._closed:
            coro.close()
            raise _closed_error()
        return self._run(coro)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """:meth:`run`, also while :meth:`close` runs (which needs the loop one last time)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise KVEngineError("KVEngine's blocking API was called from its own event loop; use a CacheEngine "
                                "(kvengine's asyncio API) there")
        with self._submit_lock:  # never submitted to a loop that is stopping: the future would never resolve
            if self._loop_stopping:
                coro.close()
                raise _closed_error()
            future = asyncio.run_coroutine_threadsafe(_contained(coro), self._loop)
            self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        outcome = future.result()  # EngineClosedError when the loop stopped before it finished (_stop_loop)
        if isinstance(outcome, _Escaped):
            raise outcome.exc
        return outcome

    def _check_open(self) -> None:
        if self._closed:
            raise _closed_error()

    def _stop_loop(self) -> None:
        with self._submit_lock:
            self._loop_stopping = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        # Calls another thread made while close() ran, that the loop stopped before finishing: they end
        # with a clear error instead of waiting forever.
        for future in list(self._pending):
            if not future.done():
                future.set_exception(_closed_error())

    def close(self, *, flush: bool = True) -> None:
        """Flush (or drop, counted) pending tier writes and stop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._run(self._core.close(flush=flush))
        finally:
            if self._stop_metrics is not None:
                self._stop_metrics()
            self._stop_loop()

    def __enter__(self) -> KVEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- API ---------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called (every method then raises :class:`EngineClosedError`)."""
        return self._closed

    @property
    def metrics(self) -> EngineMetrics:
        return self._core.metrics

    @property
    def kv_events(self) -> KVEventPublisher | None:
        """Where the engine publishes its KV events (its ``events`` section; None when off)."""
        return self._core.events

    @property
    def tier_codecs(self) -> tuple[Codec, ...]:
        """The codecs the lower tiers write with (what a load from them decodes with); none without tiers."""
        return tuple(self._core.tiers.by_codec)

    def pinned_chunks(self) -> int:
        """Pins on memory-tier chunks now (reservations, loads and queued tier writes hold them)."""
        return self._core.memory.total_pins()

    @property
    def lossy_codec(self) -> Codec | None:
        """The lossy codec the lower tiers write with (their records decode to other KV than was stored,
        so only namespaces with ``codec_family=codec_family(codec)`` bind); None when they are lossless
        or there are none. The memory tier always holds exact KV."""
        return self._core.tiers.lossy_codec

    def bind(self, namespace: Namespace, layout: ChunkLayout, *, tail_step: int = 0) -> ModelBinding:
        """:meth:`CacheEngine.bind <kvengine.core.engine.CacheEngine.bind>`; ``tail_step``: hits end at the last
        whole step of this many tokens, not the last whole chunk (:mod:`kvengine.core.tails`)."""
        self._check_open()
        return self._core.bind(namespace, layout, tail_step=tail_step)

    def lookup(
        self, binding: ModelBinding, request_id: str, tokens: TokenInput, *, max_tokens: int | None = None,
        reads: ReadScope | None = None, from_token: int = 0,
    ) -> LookupResult:
        """Reserve the longest cached chunk prefix of ``tokens`` (:meth:`CacheEngine.lookup`): a HIT or a MISS,
        which :meth:`load` or :meth:`release` ends. An engine whose only tier is memory answers in the calling
        thread, with no hop to its loop."""
        if not self._core.has_lower_tiers:
            self._check_open()
            res = self._core.lookup_resident(binding, request_id, tokens, max_tokens=max_tokens, from_token=from_token)
            if res is not None:  # None: the host service came back with lower tiers meanwhile
                return res
        return self.run(self._core.lookup(binding, request_id, tokens, max_tokens=max_tokens, reads=reads,
                                         from_token=from_token))

    def lookup_resident(
        self, binding: ModelBinding, request_id: str, tokens: TokenInput, *, max_tokens: int | None = None,
        from_token: int = 0,
    ) -> LookupResult | None:
        """:meth:`lookup` where memory alone answers it, in the calling thread (no hop to the engine's
        loop); None where lower tiers must be asked (call :meth:`lookup`)."""
        self._check_open()
        return self._core.lookup_resident(binding, request_id, tokens, max_tokens=max_tokens, from_token=from_token)

    def load(self, found: LookupResult, sink: ChunkSink) -> LoadResult:
        return self.run(self._core.load(found, in_callers_mode(sink)))

    def begin_load(self, found: LookupResult) -> tuple[ChunkView, ...]:
        """Views of every reserved chunk for a caller-driven load; :meth:`finish_load` must follow."""
        return self.run(self._core.begin_load(found))

    def finish_load(self, found: LookupResult, loaded_chunks: int) -> LoadResult:
        return self.run(self._core.finish_load(found, loaded_chunks))

    def release(self, found: LookupResult) -> None:
        """End a lookup's reservation without loading; in the calling thread (no hop to the engine's loop)."""
        self._check_open()
        self._core.release_now(found)

    def store(self, binding: ModelBinding, tokens: TokenInput, source: ChunkSource) -> StoreResult:
        """:meth:`CacheEngine.store <kvengine.core.engine.CacheEngine.store>`. An engine with no lower tier of
        its own stores in the calling thread, with no hop to its loop."""
        self._check_open()
        stored = self._core.store_resident(binding, tokens, source)
        if stored is not None:
            return stored
        return self.run(self._core.store(binding, tokens, in_callers_mode(source)))

    def begin_store(self, binding: ModelBinding, tokens: TokenInput) -> StagedStore:
        """Slots for the new chunks of ``tokens``, for the caller to fill; :meth:`commit_store` must follow."""
        return self.run(self._core.begin_store(binding, tokens))

    def commit_store(self, staged: StagedStore, filled_chunks: int) -> StoreResult:
        return self.run(self._core.commit_store(staged, filled_chunks))

    def flush(self) -> None:
        """Wait until queued tier writes are done."""
        self.run(self._core.flush())

    def reclaim_expired(self) -> int:
        return self.run(self._core.reclaim_expired())

    def is_quarantined(self, binding: ModelBinding) -> bool:
        """Whether ``binding``'s namespace failed a provenance check (nothing of it is served)."""
        self._check_open()
        return self._core.is_quarantined(binding)

    def quarantine_namespace(self, binding: ModelBinding, reason: str, **details: str) -> None:
        """Never serve or store ``binding``'s namespace again (see :mod:`kvengine.trust.quarantine`)."""
        async def quarantine() -> None:
            self._core.quarantine_namespace(binding, reason, **details)

        self.run(quarantine())


def engine_of(kv: KVEngine) -> CacheEngine:
    """The asyncio engine behind ``kv``, for kvengine's own extensions of the facade (the keyed store, peer
    sharing, provenance checks), which run on its loop through :meth:`KVEngine.run`. Not for callers: the
    facade's methods are its contract, and a caller who wants the asyncio API builds a :class:`CacheEngine`."""
    return kv._core


def _closed_error() -> EngineClosedError:
    return EngineClosedError(CLOSED_MESSAGE)

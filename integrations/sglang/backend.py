"""kvengine as an SGLang HiCache storage backend (L3 below SGLang's host pool).

Turn it on with::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvengine",
        "module_path": "kvengine.integrations.sglang.backend",
        "class_name": "KVEngineHiCacheStorage", "interface_v1": 1,
        "kvengine_config": {"memory": {"capacity_bytes": "8GiB"},
                            "disk": {"path": "/var/cache/kvengine"}}}'

SGLang builds it as ``cls(storage_config, kwargs)`` and then hands it the
host pool (``register_mem_pool_host``); only then is the engine started,
because the page geometry (and so the namespace and chunk layout) comes
from the pool. Until then every data call raises.

Zero-copy ``batch_get_v1`` / ``batch_set_v1`` copy straight between the host
pool's page regions (``get_page_buffer_meta``) and kvengine's memory tier;
the lower tiers the kvengine config names (``disk.path``, ``peers``, ``tiers``)
are filled from there per the write mode. The legacy
``get`` / ``set`` / ``batch_*`` methods take SGLang's flat pages.

Results are per key (True: stored / delivered). A fault inside kvengine (no
room, corrupt record, dead disk) is a counted miss, never an exception;
caller mistakes raise :class:`InvalidRequestError` naming the argument (key
and index counts that do not match, host indices that are not an integer
tensor, a flat page that is not a tensor of the pool's pages), and any data
call after :meth:`close` raises :class:`EngineClosedError`.

Hybrid models (SGLang's v2 methods): a KV pool plus a Mamba state pool
(``MambaPoolHost``, one state per radix node, keyed by the node's last page
hash) and/or a sliding-window KV pool (a plain MHA host pool, keyed like the
KV pages). Each pool has a namespace of its own (``pool=<name>``), so a
pool's records are never served to another pool. ``batch_exists_v2``
answers SGLang's trailing-window rule exactly, with the list of restorable
prefix lengths: a Mamba state is only ever restored for exactly the prefix
it was computed for.

Refused at start-up with :class:`UnsupportedModelError`: any other extra
pool (indexer, draft, DeepSeek-V4 compressed pools, ...), extra pools
registered after the backend started serving, host pools other than plain
MHA/MLA, layouts other than layer_first / page_first / page_first_direct,
and decode context parallelism.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvengine.chunks.layout import KVCategory
from kvengine.config import EngineConfig
from kvengine.core.copies import copy_all
from kvengine.errors import EngineClosedError, InvalidRequestError, UnsupportedModelError
from kvengine.facade import KVEngine
from kvengine.keyed import SyncKeyedStore
from kvengine.tiers import build_tiers
from kvengine.types import ModelBinding

from .options import BackendOptions, namespace_for, pool_namespace
from .pages import HostPages, MambaStates, PoolKind, geometry_of

logger = logging.getLogger("kvengine.sglang")

_HYBRID_REFUSAL = (
    "the kvengine HiCache backend stores full-attention KV pages, Mamba state ('mamba') and sliding-window KV "
    "('swa') only; this model also registers a {name!r} host pool (indexer / draft / compressed state), which "
    "it cannot serve exactly. Serve it without --hicache-storage-backend dynamic/kvengine (or with SGLang's "
    "'file' backend)."
)
#: Extra host pools this backend stores (besides the KV pool).
SUPPORTED_EXTRA_POOLS = (PoolName.MAMBA.value, PoolName.SWA.value)


@dataclass(slots=True)
class _ExtraPool:
    """A hybrid model's extra host pool: its namespace and how to address its slots."""

    name: str
    host_pool: Any
    binding: ModelBinding
    #: ``views(host_indices, num_keys)``: per key, the regions of its host slots.
    views: Callable[[torch.Tensor, int], list[list[torch.Tensor]]]
    #: Whether every rank stores it (Mamba state is TP-sharded even where MLA KV has one writer).
    every_rank_writes: bool
    store: SyncKeyedStore | None = None


class KVEngineHiCacheStorage(HiCacheStorage):
    """SGLang ``HiCacheStorage`` over a private :class:`KVEngine` (one per rank process)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        if storage_config.dcp_size != 1:
            raise UnsupportedModelError("the kvengine HiCache backend does not support decode context "
                                        f"parallelism (dcp_size={storage_config.dcp_size})")
        self.storage_config = storage_config
        self.options = BackendOptions.from_extra_config(storage_config.extra_config)
        self.is_writer = storage_config.is_storage_writer
        self.kv: KVEngine | None = None
        self._store: SyncKeyedStore | None = None
        self._pages: HostPages | None = None
        self._config: EngineConfig | None = None
        self._extra: dict[str, _ExtraPool] = {}
        #: Set once the pool set is final (on_host_pools_registered, or the first data call).
        self._sealed = False
        self._closed = False
        if not self.options.zero_copy:
            logger.warning("kvengine HiCache backend: 'interface_v1' is not set, so SGLang uses the copying "
                           "get/set path; add \"interface_v1\": 1 to the extra config")

    # -- set-up ---------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Bind the pool's page geometry and start the engine (refusals raise here)."""
        if self.kv is not None:
            raise InvalidRequestError("the kvengine HiCache backend already has a host pool")
        geometry = geometry_of(mem_pool_host)
        pages = HostPages(mem_pool_host, geometry)
        namespace = namespace_for(self.storage_config, geometry, self.options)
        layout = geometry.chunk_layout()
        config = self.options.engine_for(geometry.page_size)
        binding = ModelBinding.create(namespace, layout)
        kv = self._start_engine(config, [binding])
        super().register_mem_pool_host(mem_pool_host)
        self.kv, self._pages, self._store, self._config = kv, pages, SyncKeyedStore(kv, binding), config
        logger.info("kvengine HiCache backend: %s, %s, rank %d/%d, %s", namespace.model, geometry.describe(),
                    namespace.rank, namespace.world_size, "writer" if self.is_writer else "reader")

    def _start_engine(self, config: EngineConfig, bindings: list[ModelBinding]) -> KVEngine:
        # Each rank is a process with its own engine: its disk index holds its own namespaces only, so
        # ranks (or models) sharing a directory keep their capacity accounting apart.
        kv = KVEngine(config, transports=build_tiers(config, namespaces=[b.digest for b in bindings],
                                                      disk_options=self.options.disk_transport))
        try:
            for b in bindings:
                kv.bind(b.namespace, b.layout)
        except BaseException:
            kv.close(flush=False)
            raise
        return kv

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Every host pool of a hybrid model: the KV pool (already bound), Mamba and SWA pools (bound
        here, each in a namespace of its own); any other pool is refused, naming it."""
        name = str(host_pool_name)
        if name == PoolName.KV.value:
            if host_pool is getattr(self, "mem_pool_host", None):
                super().register_mem_host_pool_v2(host_pool, host_pool_name)
                return
            raise UnsupportedModelError(_HYBRID_REFUSAL.format(name=name))
        if name not in SUPPORTED_EXTRA_POOLS:
            raise UnsupportedModelError(_HYBRID_REFUSAL.format(name=name))
        if self.kv is None or self._store is None or self._config is None:
            raise InvalidRequestError("the kvengine HiCache backend needs its KV pool (register_mem_pool_host) "
                                      f"before the {name!r} pool")
        known = self._extra.get(name)
        if known is not None:
            if known.host_pool is host_pool:
                return
            raise UnsupportedModelError(f"a second {name!r} host pool was registered with the kvengine HiCache "
                                        "backend; it stores one pool per name")
        if self._sealed:
            raise UnsupportedModelError(
                f"the {name!r} host pool was registered after the kvengine HiCache backend started serving (a "
                "dynamic sidecar); it binds every pool's namespace at start-up, so it refuses the pool")
        pool = self._mamba_pool(host_pool) if name == PoolName.MAMBA.value else self._swa_pool(host_pool)
        # The engine's disk index is restricted to its namespaces, fixed when it starts: restart it with
        # the new pool's. Nothing has been stored yet (the pool set is not sealed).
        bindings = [self._store.binding, *(p.binding for p in self._extra.values()), pool.binding]
        old, self.kv, self._store = self.kv, None, None
        for p in self._extra.values():
            p.store = None
        old.close()
        kv = self._start_engine(self._config, bindings)
        self.kv, self._store = kv, SyncKeyedStore(kv, bindings[0])
        self._extra[name] = pool
        for p in self._extra.values():
            p.store = SyncKeyedStore(kv, p.binding)
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        logger.info("kvengine HiCache backend: %s pool bound (%s)", name, pool.binding.namespace.kv_spec_fingerprint)

    def on_host_pools_registered(self) -> None:
        """The pool set is final: a pool registered later is refused."""
        self._sealed = True

    def _kv_namespace_fingerprint(self) -> str:
        assert self._store is not None
        return self._store.binding.namespace.model_fingerprint

    def _mamba_pool(self, host_pool: Any) -> _ExtraPool:
        assert self._config is not None
        states = MambaStates(host_pool)
        namespace = pool_namespace(self.storage_config, self.options, pool=PoolName.MAMBA.value,
                                   spec=states.geometry.describe(), layout_id="sglang-hicache/mamba-state",
                                   model_fingerprint=self._kv_namespace_fingerprint())
        binding = ModelBinding.create(namespace, states.geometry.chunk_layout(self._config.chunk_size))
        return _ExtraPool(PoolName.MAMBA.value, host_pool, binding, states.page_views, every_rank_writes=True)

    def _swa_pool(self, host_pool: Any) -> _ExtraPool:
        assert self._pages is not None
        if self.storage_config.is_mla_model:
            raise UnsupportedModelError("a sliding-window ('swa') host pool on an MLA model is not supported by the "
                                        "kvengine HiCache backend (which ranks hold which SWA heads is unknown)")
        geometry = geometry_of(host_pool)
        if geometry.kind is not PoolKind.MHA:
            raise UnsupportedModelError(f"the kvengine HiCache backend stores sliding-window KV from "
                                        f"MHATokenToKVPoolHost only; this model's 'swa' pool is {type(host_pool).__name__}")
        if geometry.page_size != self._pages.geometry.page_size:
            raise UnsupportedModelError(f"the 'swa' host pool's page size {geometry.page_size} differs from the KV "
                                        f"pool's {self._pages.geometry.page_size}; the kvengine HiCache backend "
                                        "stores one page per key in both")
        pages = HostPages(host_pool, geometry)
        namespace = pool_namespace(self.storage_config, self.options, pool=PoolName.SWA.value,
                                   spec=geometry.describe(), layout_id=f"sglang-hicache/{geometry.host_layout}",
                                   model_fingerprint=self._kv_namespace_fingerprint())
        binding = ModelBinding.create(namespace, geometry.chunk_layout(KVCategory.SLIDING_WINDOW))
        return _ExtraPool(PoolName.SWA.value, host_pool, binding, pages.page_views, every_rank_writes=False)

    def close(self) -> None:
        """Flush pending disk writes and stop the engine (SGLang calls this on detach). Idempotent."""
        self._closed = True
        kv, self.kv, self._store, self._pages = self.kv, None, None, None
        for pool in self._extra.values():
            pool.store = None
        if kv is not None:
            kv.close()

    @property
    def binding(self) -> ModelBinding:
        return self._keyed().binding

    def _keyed(self) -> SyncKeyedStore:
        if self._closed:
            raise EngineClosedError("the kvengine HiCache backend is closed")
        if self._store is None:
            raise InvalidRequestError("the kvengine HiCache backend has no host pool yet (register_mem_pool_host)")
        self._sealed = True  # serving has begun: the pool set (and so the engine's namespaces) is final
        return self._store

    # -- zero-copy (v1) ------------------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many of ``keys``, from the first, are stored and verified.

        SGLang sizes its prefetch by this answer, so pages found only on disk or
        at a peer are read, verified and promoted into kvengine's memory before
        they are counted: a corrupt page is a miss now, not a failed load later.
        """
        if not keys:
            return 0
        found = self._keyed().exists(_key_bytes(keys), verify=True)
        return next((i for i, hit in enumerate(found) if not hit), len(found))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Copy stored pages into the host pool slots ``host_indices`` (page_size per key)."""
        store = self._keyed()
        views = self._page_views(keys, host_indices)
        if not views:
            return []

        def sink(i: int, tensors: tuple[torch.Tensor, ...]) -> None:
            copy_all(views[i], tensors)

        return [o.ok for o in store.get(_key_bytes(keys), sink)]

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store the pages in host pool slots ``host_indices``; a non-writer MLA rank stores nothing."""
        store = self._keyed()
        views = self._page_views(keys, host_indices)
        if not self.is_writer or not views:
            return [True] * len(keys)
        return [o.ok for o in store.put(_key_bytes(keys), views.__getitem__)]

    def _page_views(self, keys: list[str], host_indices: torch.Tensor) -> list[list[torch.Tensor]]:
        assert self._pages is not None
        return self._pages.page_views(host_indices, len(keys))

    # -- copying API (SGLang's flat pages) ---------------------------------------------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        _flat_page(target_location, "target_location")
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        store = self._keyed()
        if target_locations is None or len(target_locations) != len(keys):
            raise InvalidRequestError("batch_get needs one flat target page per key (target_locations)")
        geometry = self._pages.geometry  # type: ignore[union-attr]
        regions = [geometry.legacy_regions(_flat_page(t, f"target_locations[{i}]"))
                   for i, t in enumerate(target_locations)]

        def sink(i: int, tensors: tuple[torch.Tensor, ...]) -> None:
            copy_all(regions[i], tensors)

        outcomes = store.get(_key_bytes(keys), sink)
        return [t if o.ok else None for t, o in zip(target_locations, outcomes)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        _flat_page(value, "value")
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        store = self._keyed()
        if values is None or len(values) != len(keys):
            raise InvalidRequestError("batch_set needs one flat page per key (values)")
        pages = [_flat_page(v, f"values[{i}]") for i, v in enumerate(values)]
        if not self.is_writer:
            return True
        geometry = self._pages.geometry  # type: ignore[union-attr]
        regions = [geometry.legacy_regions(v.contiguous()) for v in pages]
        return all(o.ok for o in store.put(_key_bytes(keys), regions.__getitem__))

    # -- hybrid models (v2) ------------------------------------------------------------------
    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """The usable prefix of ``keys`` over the KV pool and every pool of ``pool_transfers``.

        ``restorable_prefix_pages`` lists every prefix length P (pages of ``keys``) that can be
        restored: all KV pages ``keys[:P]`` are stored and, for each extra pool, the pages its hit
        policy needs. TRAILING_PAGES (Mamba, SWA) with a window of n keys (the transfer's key count;
        its keys are placeholders) needs ``keys[max(0, P-n):P]`` in that pool: a Mamba state (n = 1)
        is stored under the last page hash of exactly the prefix it belongs to, so P is restorable
        only where a state of exactly that prefix is stored. Every stored record counted is read and
        verified first (as in :meth:`batch_exists`).
        """
        self._sealed = True
        transfers = [t for t in pool_transfers or [] if str(t.name) != PoolName.KV.value]
        pools = [self._extra_pool(t) for t in transfers]
        kv_pages = self.batch_exists(keys)
        hits: dict[str, int] = {PoolName.KV.value: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer, pool in zip(transfers, pools):
            if not restorable:
                break
            found = self._extra_store(pool).exists(_key_bytes(keys[:kv_pages]), verify=True)
            if transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                window = max(1, len(transfer.keys or ()))
                ok = {p for p in range(1, kv_pages + 1) if all(found[max(0, p - window):p])}
            elif transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                ok = set(range(1, next((i for i, hit in enumerate(found) if not hit), kv_pages) + 1))
            else:  # a hit policy these pools never use: nothing of it is promised
                logger.error("kvengine HiCache backend: hit policy %s for the %r pool is not supported; "
                             "answered as a miss", transfer.hit_policy, pool.name)
                ok = set()
            if ok:
                hits[transfer.name] = max(ok)
            restorable = [p for p in restorable if p in ok]
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Copy each transfer's stored records into its pool's host slots; per pool, per key."""
        self._sealed = True
        results: dict[str, list[bool]] = {}
        for transfer in transfers:
            keys = list(transfer.keys or [])
            if str(transfer.name) == PoolName.KV.value:
                results[transfer.name] = self.batch_get_v1(keys, _indices(transfer))
                continue
            pool = self._extra_pool(transfer)
            indices = _indices(transfer)
            views = pool.views(indices, len(keys)) if keys else []

            def sink(i: int, tensors: tuple[torch.Tensor, ...], views: list[list[torch.Tensor]] = views) -> None:
                copy_all(views[i], tensors)

            results[transfer.name] = [o.ok for o in self._extra_store(pool).get(_key_bytes(keys), sink)] \
                if keys else []
        return results

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Store each transfer's host slots under its keys, in its pool's namespace; per pool, per key."""
        self._sealed = True
        results: dict[str, list[bool]] = {}
        for transfer in transfers:
            keys = list(transfer.keys or [])
            if str(transfer.name) == PoolName.KV.value:
                results[transfer.name] = self.batch_set_v1(keys, _indices(transfer))
                continue
            pool = self._extra_pool(transfer)
            indices = _indices(transfer)
            views = pool.views(indices, len(keys)) if keys else []
            if not keys or not (pool.every_rank_writes or self.is_writer):
                results[transfer.name] = [True] * len(keys)
                continue
            results[transfer.name] = [o.ok for o in self._extra_store(pool).put(_key_bytes(keys), views.__getitem__)]
        return results

    def _extra_pool(self, transfer: PoolTransfer) -> _ExtraPool:
        pool = self._extra.get(str(transfer.name))
        if pool is None:
            raise UnsupportedModelError(_HYBRID_REFUSAL.format(name=str(transfer.name)) if str(transfer.name)
                                        not in SUPPORTED_EXTRA_POOLS else
                                        f"the {str(transfer.name)!r} host pool was never registered with the "
                                        "kvengine HiCache backend (register_mem_host_pool_v2)")
        return pool

    def _extra_store(self, pool: _ExtraPool) -> SyncKeyedStore:
        if pool.store is None:
            raise EngineClosedError("the kvengine HiCache backend is closed")
        return pool.store

    # -- misc -----------------------------------------------------------------------------
    def clear(self) -> None:
        """Nothing to do: pages are addressed by their token-chain hash and stay valid after a flush."""

    def get_stats(self) -> None:
        """kvengine's own Prometheus metrics (``metrics_port``) carry the numbers; SGLang gets none."""
        return None


def _key_bytes(keys: list[str]) -> list[bytes]:
    try:
        return [k.encode() for k in keys]
    except AttributeError:
        raise InvalidRequestError("SGLang page keys must be strings") from None


def _flat_page(page: Any, argument: str) -> torch.Tensor:
    """``page``, a flat page of SGLang's copying API; :class:`InvalidRequestError` naming ``argument`` if
    it is not a tensor (its dtype and size are checked against the pool by ``legacy_regions``)."""
    if not isinstance(page, torch.Tensor):
        raise InvalidRequestError(f"{argument} must be a torch.Tensor (a flat page of the host pool), "
                                  f"got {type(page).__name__}")
    return page


def _indices(transfer: PoolTransfer) -> torch.Tensor:
    if transfer.host_indices is None:
        if transfer.keys:
            raise InvalidRequestError(f"the {str(transfer.name)!r} transfer has keys but no host indices")
        return torch.empty(0, dtype=torch.int64)
    return transfer.host_indices


__all__ = ["KVEngineHiCacheStorage"]

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
caller mistakes (key/index counts that do not match) raise.

Refused at start-up with :class:`UnsupportedModelError`: hybrid models
(Mamba, SWA, indexer or draft pools: the v2 methods), host pools other than
plain MHA/MLA, layouts other than layer_first / page_first /
page_first_direct, and decode context parallelism.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvengine.core.copies import copy_all
from kvengine.errors import InvalidRequestError, UnsupportedModelError
from kvengine.facade import KVEngine
from kvengine.keyed import SyncKeyedStore
from kvengine.tiers import build_tiers
from kvengine.types import ModelBinding

from .options import BackendOptions, namespace_for
from .pages import HostPages, geometry_of

logger = logging.getLogger("kvengine.sglang")

_HYBRID_REFUSAL = (
    "the kvengine HiCache backend stores full-attention KV pages only; this model also registers a {name!r} "
    "host pool (hybrid Mamba / sliding-window / indexer / draft state). Serve it without "
    "--hicache-storage-backend dynamic/kvengine (or with SGLang's 'file' backend)."
)


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
        # Each rank is a process with its own engine: its disk index holds its own namespace only, so
        # ranks (or models) sharing a directory keep their capacity accounting apart.
        kv = KVEngine(config, transports=build_tiers(config, namespaces=[binding.digest],
                                                      disk_options=self.options.disk_transport))
        try:
            kv.bind(namespace, layout)
        except BaseException:
            kv.close(flush=False)
            raise
        super().register_mem_pool_host(mem_pool_host)
        self.kv, self._pages, self._store = kv, pages, SyncKeyedStore(kv, binding)
        logger.info("kvengine HiCache backend: %s, %s, rank %d/%d, %s", namespace.model, geometry.describe(),
                    namespace.rank, namespace.world_size, "writer" if self.is_writer else "reader")

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        if str(host_pool_name) == PoolName.KV.value and host_pool is getattr(self, "mem_pool_host", None):
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
            return
        raise UnsupportedModelError(_HYBRID_REFUSAL.format(name=str(host_pool_name)))

    def close(self) -> None:
        """Flush pending disk writes and stop the engine (SGLang calls this on detach). Idempotent."""
        kv, self.kv, self._store, self._pages = self.kv, None, None, None
        if kv is not None:
            kv.close()

    @property
    def binding(self) -> ModelBinding:
        return self._keyed().binding

    def _keyed(self) -> SyncKeyedStore:
        if self._store is None:
            raise InvalidRequestError("the kvengine HiCache backend has no host pool yet (register_mem_pool_host)")
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
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        store = self._keyed()
        if target_locations is None or len(target_locations) != len(keys):
            raise InvalidRequestError("batch_get needs one flat target page per key")
        geometry = self._pages.geometry  # type: ignore[union-attr]
        regions = [geometry.legacy_regions(t) for t in target_locations]

        def sink(i: int, tensors: tuple[torch.Tensor, ...]) -> None:
            copy_all(regions[i], tensors)

        outcomes = store.get(_key_bytes(keys), sink)
        return [t if o.ok else None for t, o in zip(target_locations, outcomes)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        store = self._keyed()
        if values is None or len(values) != len(keys):
            raise InvalidRequestError("batch_set needs one flat page per key")
        if not self.is_writer:
            return True
        geometry = self._pages.geometry  # type: ignore[union-attr]
        regions = [geometry.legacy_regions(v.contiguous()) for v in values]
        return all(o.ok for o in store.put(_key_bytes(keys), regions.__getitem__))

    # -- hybrid models (v2): refused ------------------------------------------------------------
    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        raise UnsupportedModelError(_HYBRID_REFUSAL.format(name=_first_pool(pool_transfers)))

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        raise UnsupportedModelError(_HYBRID_REFUSAL.format(name=_first_pool(transfers)))

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        raise UnsupportedModelError(_HYBRID_REFUSAL.format(name=_first_pool(transfers)))

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


def _first_pool(transfers: list[PoolTransfer] | None) -> str:
    names = [str(t.name) for t in transfers or [] if str(t.name) != PoolName.KV.value]
    return names[0] if names else "hybrid"


__all__ = ["KVEngineHiCacheStorage"]

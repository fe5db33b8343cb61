"""The backend's settings (from SGLang's extra config) and the namespace of its pages.

Extra config keys (``--hicache-storage-backend-extra-config``, JSON):

* SGLang's own: ``backend_name``, ``module_path``, ``class_name``,
  ``interface_v1`` (set it to 1: the zero-copy path).
* ``kvengine_config``: kvengine's configuration, a mapping or a YAML path
  (``KVENGINE_*`` environment variables override it as usual). Its
  ``chunk_size`` is SGLang's page size: leave it unset (or ``"auto"``); an
  explicit value other than the page size is refused, naming the page size.
* ``model``: the model identity to namespace pages by (default: SGLang's
  ``model_name``, i.e. ``--served-model-name`` or the model path).
* ``model_fingerprint``: the model's identity, when you version weights
  yourself. By default every byte of the weight files of ``model`` (a local
  path or a downloaded hub id) is hashed (:mod:`kvengine.trust.weights`); a model
  that cannot be found to hash is refused unless this is set.
* ``disk_transport``: options of the local-disk tier beyond kvengine's
  ``disk`` section: ``direct_io`` (None: O_DIRECT for large records where
  the filesystem allows; False: through the page cache), ``io_threads``,
  ``read_pool_bytes``.

Any other key is refused, naming the allowed ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvengine.chunks.keys import Namespace
from kvengine.config import EngineConfig, load_config_auto_chunk
from kvengine.errors import ConfigError
from kvengine.keyed import keyed_namespace
from kvengine.trust.weights import model_identity

from .pages import PageGeometry, PoolKind

SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
OWN_KEYS = frozenset({"kvengine_config", "model", "model_fingerprint", "disk_transport"})
DISK_TRANSPORT_KEYS = frozenset({"direct_io", "io_threads", "read_pool_bytes"})
#: Name of the key scheme: SGLang's page hashes (sha256 chains over token ids, hex).
KEY_SCHEME = "sglang-page-hash"


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendOptions:
    #: The cache engine's settings; its ``chunk_size`` is set by :meth:`engine_for`.
    engine: EngineConfig
    #: The requested chunk size (None: "auto", SGLang's page size).
    chunk_size: int | None = None
    model: str | None = None
    model_fingerprint: str = ""
    zero_copy: bool = False
    disk_transport: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> BackendOptions:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - SGLANG_KEYS - OWN_KEYS)
        if unknown:
            raise ConfigError(f"unknown kvengine HiCache backend option(s) {unknown}; allowed: "
                              f"{sorted(OWN_KEYS)} (and SGLang's {sorted(SGLANG_KEYS)})")
        model = extra.get("model")
        fingerprint = extra.get("model_fingerprint", "")
        if model is not None and (not isinstance(model, str) or not model):
            raise ConfigError("extra config 'model' must be a non-empty string")
        if not isinstance(fingerprint, str):
            raise ConfigError("extra config 'model_fingerprint' must be a string")
        source = extra.get("kvengine_config")
        if source is not None and not isinstance(source, (str, Mapping)):
            raise ConfigError("extra config 'kvengine_config' must be a mapping or a YAML path")
        disk = extra.get("disk_transport") or {}
        if not isinstance(disk, Mapping) or set(disk) - DISK_TRANSPORT_KEYS:
            raise ConfigError(f"extra config 'disk_transport' must be a mapping with keys from "
                              f"{sorted(DISK_TRANSPORT_KEYS)}, got {disk!r}")
        engine, chunk_size = load_config_auto_chunk(source)
        return cls(engine=engine, chunk_size=chunk_size, model=model, model_fingerprint=fingerprint,
                   zero_copy=bool(int(extra.get("interface_v1", 0) or 0)), disk_transport=dict(disk))

    def engine_for(self, page_size: int) -> EngineConfig:
        """The engine configuration with ``chunk_size`` set to SGLang's page size."""
        if self.chunk_size not in (None, page_size):
            raise ConfigError(f"kvengine chunk_size {self.chunk_size} differs from SGLang's page size "
                              f"{page_size} (a kvengine chunk is one SGLang page); set it to {page_size} "
                              "or 'auto', or leave it unset")
        return EngineConfig.model_validate({**self.engine.model_dump(), "chunk_size": page_size})


def namespace_for(storage_config: Any, geometry: PageGeometry, options: BackendOptions) -> Namespace:
    """Where this rank's pages live.

    MHA KV is sharded over tensor-parallel ranks (heads), so the rank and TP
    size are part of the namespace; MLA KV is the same on every rank, so all
    ranks share one namespace (only the storage writer puts). Pipeline and
    attention context-parallel shards hold different layers or tokens, so
    they always split the namespace. The host layout, dtype and geometry are
    in it too (``layout_id`` and the chunk layout), so a page is only ever
    read as the bytes it was written as.
    """
    replicated = geometry.kind is PoolKind.MLA or bool(storage_config.is_mla_model)
    return _namespace(storage_config, options, spec=geometry.describe(),
                      layout_id=f"sglang-hicache/{geometry.host_layout}", replicated=replicated)


def pool_namespace(storage_config: Any, options: BackendOptions, *, pool: str, spec: str, layout_id: str,
                   model_fingerprint: str) -> Namespace:
    """Where a hybrid model's extra host pool (``pool``: "mamba", "swa") keeps its records.

    Like the KV pool's namespace plus ``pool=<name>``, so one pool's records are
    never served to another pool (nor to the KV pool), whatever the key. Extra
    pools are always split by TP rank: Mamba state and sliding-window KV are
    sharded over heads even where a model's MLA KV is replicated. ``model_fingerprint``
    is the KV pool's (the weights are hashed once).
    """
    return _namespace(storage_config, options, spec=spec, layout_id=layout_id, replicated=False,
                      pool=pool, model_fingerprint=model_fingerprint)


def _namespace(storage_config: Any, options: BackendOptions, *, spec: str, layout_id: str, replicated: bool,
               pool: str | None = None, model_fingerprint: str | None = None) -> Namespace:
    model = options.model or storage_config.model_name
    if not model:
        raise ConfigError("SGLang passed no model name to the kvengine HiCache backend; set 'model' in "
                          "--hicache-storage-backend-extra-config")
    if getattr(storage_config, "should_split_heads", False) or getattr(storage_config, "tp_lcm_size", None):
        raise ConfigError("tp_lcm_size (heterogeneous TP head splitting) is not supported by the kvengine "
                          "HiCache backend")
    extra: tuple[str, ...] = (f"pp={storage_config.pp_rank}/{storage_config.pp_size}",
                              f"attn_cp={storage_config.attn_cp_rank}/{storage_config.attn_cp_size}")
    if pool is not None:
        extra = (*extra, f"pool={pool}")
    namespace = Namespace(
        model=model,
        model_fingerprint=model_fingerprint or model_identity(model, explicit=options.model_fingerprint or None),
        kv_spec_fingerprint=spec,
        layout_id=layout_id,
        rank=0 if replicated else int(storage_config.tp_rank),
        world_size=1 if replicated else int(storage_config.tp_size),
        extra_keys=extra,
    )
    return keyed_namespace(namespace, KEY_SCHEME)

"""The one configuration object, typed and validated.

Sources, later ones overriding earlier ones: defaults; a dict or YAML file
(or, when none is given, the YAML file named by ``KVENGINE_CONFIG_FILE``);
``KVENGINE_*`` environment variables; then explicit ``overrides`` (a
command's own arguments: what a user typed is never overridden by the
environment). Nested keys use ``__`` in the environment
(``KVENGINE_MEMORY__CAPACITY_BYTES=8GiB``); list and mapping settings take
JSON (``KVENGINE_PEERS__PEERS='["10.0.0.2:7400", "10.0.0.3:7400"]'``).
Unknown keys (with did-you-mean suggestions) and invalid values raise
:class:`ConfigError` naming the key and what is allowed. Numbers are numbers:
``true`` / ``false`` are refused where a count, size or duration is expected
(pydantic would read ``chunk_size: true`` as 1). An
:class:`EngineConfig` is final: passing one again applies nothing more.

This is hand-written rather than ``pydantic-settings``: that would ignore a
mistyped ``KVENGINE_`` variable instead of refusing it, and would make every
``EngineConfig()`` read the process environment as a hidden input; the merge
below is the few lines that need neither.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from kvengine.addresses import split_host_port
from kvengine.errors import ConfigError

ENV_PREFIX = "KVENGINE_"
#: The YAML file to read when no configuration source is given (not a key of the configuration).
CONFIG_FILE_VAR = "KVENGINE_CONFIG_FILE"
#: The least ``memory.capacity_bytes`` and ``memory.slab_bytes`` accepted: below it a size is almost
#: surely a unit left out ("100" is 100 bytes), and no chunk of a real model fits.
MIN_MEMORY_BYTES = 1024


def _not_bool(value: object) -> object:
    """Refuse a boolean where a number is expected (``bool`` is an ``int``: pydantic takes ``true`` as 1)."""
    if isinstance(value, bool):
        raise ValueError(f"must be a number, got the boolean {value!r}")
    return value


#: Numeric setting types that refuse booleans (strings still convert: environment variables are strings).
Int = Annotated[int, BeforeValidator(_not_bool)]
Float = Annotated[float, BeforeValidator(_not_bool)]
Bytes = Annotated[ByteSize, BeforeValidator(_not_bool)]


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


#: A tenant of the host service's arena (``memory.tenant``, ``kvengine host --quota NAME=SIZE``).
TENANT_NAME = re.compile(r"[A-Za-z0-9_.@:-]{1,64}")


def check_tenant(name: str) -> str:
    """``name`` if it is a tenant name, else ValueError saying what one is."""
    if not TENANT_NAME.fullmatch(name):
        raise ValueError(f"a tenant name is 1-64 letters, digits or _.@:- characters, got {name!r}")
    return name


class MemoryConfig(_Section):
    """L1 host-memory tier."""

    #: At least MIN_MEMORY_BYTES, and at most what this machine can allocate (checked when an engine
    #: starts: a ConfigError naming this key).
    capacity_bytes: Bytes = ByteSize(2 * 2**30)
    #: Allocation slab; every stored chunk must fit one. Default: capacity/16
    #: clamped to [1 MiB, 256 MiB]. At least MIN_MEMORY_BYTES.
    slab_bytes: Bytes | None = None
    eviction: Literal["lru", "fifo"] = "lru"
    #: Touch the whole arena at start so the first stores take no page faults
    #: (costs about capacity / memory bandwidth at start-up).
    prefault: bool = False
    #: Attach to the host's ``kvengine host`` service on this Unix socket ("unix:///run/kvengine.sock"
    #: or a path) instead of holding an arena of this engine's own: the settings above are then the
    #: service's (see docs/host.md). The engine refuses to start when the service does not answer.
    service: str | None = None
    #: With ``service``: the tenant this engine's chunks are counted to; a tenant given a quota by the
    #: service (``kvengine host --quota NAME=SIZE``) has that share of the arena to itself, the others
    #: share the rest.
    tenant: str = ""

    @field_validator("tenant")
    @classmethod
    def _tenant_name(cls, value: str) -> str:
        return check_tenant(value) if value else value

    @field_validator("service")
    @classmethod
    def _socket_path(cls, value: str | None) -> str | None:
        if value is None:
            return None
        path = value.removeprefix("unix://")
        if not path.startswith("/"):
            raise ValueError(f"must be an absolute Unix socket path (unix:///path or /path), got {value!r}")
        return path

    @field_validator("capacity_bytes", "slab_bytes")
    @classmethod
    def _at_least_minimum(cls, value: ByteSize | None) -> ByteSize | None:
        if value is not None and value < MIN_MEMORY_BYTES:
            raise ValueError(f"must be at least {MIN_MEMORY_BYTES} B (1KiB), got {int(value)} B (a number "
                             "without a unit is bytes: write e.g. '100MiB')")
        return value

    def effective_slab_bytes(self) -> int:
        if self.slab_bytes is not None:
            return int(self.slab_bytes)
        return int(min(self.capacity_bytes, max(2**20, min(256 * 2**20, self.capacity_bytes // 16))))


class DiskConfig(_Section):
    """Local-disk tier below memory (disabled when ``path`` is unset)."""

    path: Path | None = None
    capacity_bytes: Bytes = Field(default=ByteSize(64 * 2**30), gt=0)
    fsync: Literal["never", "data", "always"] = "data"
    #: Codec of the records written to disk (see kvengine.compression); also
    #: the codec of transports handed to the engine without a Tier.
    codec: str = "raw"


class ShadowConfig(_Section):
    """Shadow verification: some hits are recomputed by the inference engine instead of loaded, and the
    KV it computed is compared with the stored chunks (a mismatch quarantines the namespace).

    Off by default: each shadowed hit costs its prefill. Recommended where the KV a model computes can
    change under a cache (library, kernel or driver upgrades): ``first_hits: 4, fraction: 0.01``.
    """

    #: The first this many hits of each namespace after start are shadowed.
    first_hits: Int = Field(default=0, ge=0)
    #: Then each hit with this probability.
    fraction: Float = Field(default=0.0, ge=0.0, le=1.0)
    #: Seed of the sampling (a run is reproducible).
    seed: Int = 0

    @property
    def enabled(self) -> bool:
        return self.first_hits > 0 or self.fraction > 0


class PeersConfig(_Section):
    """Peer sharing tier (off unless ``peers`` or ``peers_file`` is set)."""

    #: tcp (kvengine's own framing, every message bounded before it is buffered; TLS for identity; the default,
    #: as for `kvengine serve`), zmq (CURVE for identity; libzmq buffers a message whole before kvengine sees it)
    #: or ucx (RDMA / shared memory; no transport security).
    transport: Literal["zmq", "tcp", "ucx"] = "tcp"
    #: Codec of the records sent to peers. Must be of the disk codec's family.
    codec: str = "raw"
    #: Static peer list, "host:port" each.
    peers: tuple[str, ...] = ()
    #: A file with one "host:port" a line, reloaded when it changes.
    peers_file: Path | None = None
    reload_interval: Float = Field(default=1.0, gt=0)
    #: Owners per chunk (rendezvous hashing over the peer list).
    replicas: Int = Field(default=2, ge=1)
    request_timeout: Float = Field(default=0.5, gt=0)
    read_deadline: Float = Field(default=1.0, gt=0)
    write_timeout: Float = Field(default=5.0, gt=0)
    #: A peer that failed is skipped this long.
    cooldown: Float = Field(default=5.0, gt=0)
    #: Bound on bytes of writes in flight to peers (backpressure beyond it).
    max_inflight_write_bytes: Bytes = ByteSize(256 * 2**20)
    #: A file holding the peer group's shared secret (>= 16 bytes): records sent to peers carry a
    #: keyed MAC, records received must verify. Required for peers off loopback unless CURVE is on.
    secret_file: Path | None = None
    #: CURVE keys (Z85), ZeroMQ only.
    curve_public_key: str | None = None
    curve_secret_key: str | None = None
    curve_server_key: str | None = None
    #: TLS (tcp only), PEM files: the CA of the peers' certificates (turns TLS on), and this client's
    #: certificate and key for servers that require one (their tenants file names its fingerprint).
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None


class MooncakeConfig(_Section):
    """A Mooncake Store tier below disk and peers (off unless ``master`` is set): a cluster-wide KV pool
    whose placement, replication and eviction Mooncake's master runs. Only its TCP transport is
    validated (RDMA is refused until it is)."""

    #: The master's RPC address, "host:port".
    master: str | None = None
    #: This node's address in the cluster; Mooncake's data connections are bound to it too.
    local_hostname: str = "127.0.0.1"
    #: Memory this node contributes to the cluster's pool (0: a client only; others hold its chunks).
    segment_bytes: Bytes = ByteSize(1 * 2**30)
    #: Copies Mooncake keeps of each chunk (on distinct nodes).
    replicas: Int = Field(default=1, ge=1)
    #: Codec of the records written to it. Must be of the disk codec's family.
    codec: str = "raw"
    #: Every call to the store ends within this time (a dead or stalled master: a miss, never a wait).
    timeout: Float = Field(default=1.0, gt=0)
    #: A file holding the cluster's shared secret (>= 16 bytes): records written carry a keyed MAC,
    #: records read must verify. Required when the master is off loopback.
    secret_file: Path | None = None

    @field_validator("master")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is not None:
            split_host_port(value, any_port=False)
        return value


class TierConfig(_Section):
    """A tier from another package, below disk and peers: a transport registered under the
    ``kvengine.transports`` entry-point group, found by its name."""

    transport: str = Field(min_length=1)
    #: Codec of the records written to it. Must be of the disk codec's family.
    codec: str = "raw"
    #: Passed to the transport's factory as they are.
    options: dict[str, Any] = Field(default_factory=dict)


_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


class EventsConfig(_Section):
    """KV cache events for KV-aware routers (llm-d, Dynamo): chunks entering and leaving tiers, in vLLM's
    wire format on a ZeroMQ PUB socket (see kvengine/events.py, docs/kv_events.md). Off unless
    ``endpoint`` is set. The events carry prompts' token ids: keep the socket on a trusted network."""

    #: ZeroMQ address, e.g. "tcp://127.0.0.1:5557". As vLLM: a wildcard host ("tcp://*:5557"), ipc:// and
    #: inproc:// are bound; other addresses are connected to (a router that binds, as llm-d's indexer).
    endpoint: str | None = None
    #: Bind (True) or connect (False) ``endpoint`` regardless of its form (unset: the rule above).
    bind: bool | None = None
    #: First frame of every message (routers subscribe by prefix; llm-d reads "kv@<pod>@<model>").
    topic: str = ""
    #: A ROUTER address (always bound) answering replay requests for missed batches, as vLLM's.
    replay_endpoint: str | None = None
    #: Batches kept for replay (only with ``replay_endpoint``).
    buffer_steps: Int = Field(default=1000, ge=1)
    #: Events queued for the publishing thread at most; beyond it they are dropped (counted).
    queue_size: Int = Field(default=10_000, gt=0)
    #: Block hashes as kvengine's 16-byte hashes, or as vLLM's integer form (low 64 bits, big-endian;
    #: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) for routers that decode unsigned 64-bit hashes.
    hash_format: Literal["bytes", "int64"] = "bytes"
    #: ``data_parallel_rank`` of every batch.
    data_parallel_rank: Int = Field(default=0, ge=0)

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _zmq_address(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(_ZMQ_SCHEMES):
            raise ValueError(f"must be a ZeroMQ address ({', '.join(_ZMQ_SCHEMES)}...), got {value!r}")
        return value


class EngineConfig(_Section):
    chunk_size: Int = Field(default=256, gt=0, le=1 << 20)
    #: Store a trailing partial chunk too (rarely matched; see hashing.py).
    store_partial_chunks: bool = False
    #: A reservation not loaded or released within this time is reclaimed.
    lease_seconds: Float = Field(default=30.0, gt=0)
    #: write_behind: stores return once in memory, lower tiers fill in the
    #: background; write_through: stores return once every tier has the chunk
    #: (each chunk's tier writes start as soon as it is copied).
    write_mode: Literal["write_behind", "write_through"] = "write_behind"
    #: Bound on queued background writes (besides the few being written); beyond it they are dropped (counted).
    max_pending_writes: Int = Field(default=256, gt=0)
    memory: MemoryConfig = MemoryConfig()
    disk: DiskConfig = DiskConfig()
    peers: PeersConfig = PeersConfig()
    mooncake: MooncakeConfig = MooncakeConfig()
    #: More tiers, by registered transport name, looked up after disk, peers and Mooncake.
    tiers: tuple[TierConfig, ...] = ()
    shadow: ShadowConfig = ShadowConfig()
    #: KV cache events for KV-aware routers (off unless ``events.endpoint`` is set).
    events: EventsConfig = EventsConfig()
    #: Serve Prometheus metrics over HTTP on this port (off when unset).
    metrics_port: Int | None = Field(default=None, ge=0, le=65535)
    #: Address the metrics exporter binds (loopback by default: metrics name models and tenants).
    metrics_host: str = "127.0.0.1"
    #: Level of kvengine's loggers ("kvengine" and below; debug adds a line per lookup and load). Unset:
    #: as the application configured logging. ``KVENGINE_LOG_LEVEL`` sets it from the environment.
    log_level: Literal["debug", "info", "warning", "error"] | None = None

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _consistent(self) -> EngineConfig:
        if self.memory.effective_slab_bytes() > self.memory.capacity_bytes:
            raise ValueError(f"memory.slab_bytes ({self.memory.effective_slab_bytes()} B) must not exceed "
                             f"memory.capacity_bytes ({int(self.memory.capacity_bytes)} B)")
        curve = (self.peers.curve_public_key, self.peers.curve_secret_key, self.peers.curve_server_key)
        if self.peers.transport != "zmq" and any(curve):
            raise ValueError(f"peers.curve_* keys are ZeroMQ-only, not for peers.transport={self.peers.transport}")
        if self.memory.service is not None and self.events.endpoint is not None:
            raise ValueError("events.endpoint: with memory.service, the host service publishes the KV events of "
                             "its arena (it evicts chunks this engine never sees): set events in its configuration "
                             "(kvengine host --config) instead")
        tls = (self.peers.tls_ca, self.peers.tls_cert, self.peers.tls_key)
        if self.peers.transport != "tcp" and any(tls):
            raise ValueError(f"peers.tls_* files are for peers.transport=tcp, not {self.peers.transport}")
        return self


def _allowed_keys(loc: tuple[object, ...]) -> list[str]:
    model: type[BaseModel] = EngineConfig
    for part in loc[:-1]:
        annotation = model.model_fields[str(part)].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return sorted(model.model_fields)


def _error(exc: ValidationError) -> ConfigError:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        msg = err["msg"]
        if err["type"] == "value_error":  # our own validators' messages, without pydantic's prefix
            msg = msg.removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            allowed = _allowed_keys(err["loc"])
            close = difflib.get_close_matches(str(err["loc"][-1]), allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            msg = f"unknown key ({hint}allowed keys: {', '.join(allowed)})"
        lines.append(f"{key}: {msg}")
    return ConfigError("invalid kvengine configuration: " + "; ".join(lines))


def _env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name == CONFIG_FILE_VAR:
            continue
        path = name[len(ENV_PREFIX) :].lower().split("__")
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"environment variable {name} conflicts with another KVENGINE_ variable")
        node[path[-1]] = _env_value(name, value)
    return out


def _env_value(name: str, value: str) -> Any:
    """A variable's value: None for empty/none/null, JSON for lists and mappings, else the string
    (pydantic converts it to the key's type)."""
    if value.lower() in ("", "none", "null"):
        return None
    if value.lstrip()[:1] in ("[", "{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"environment variable {name}: not valid JSON ({exc})") from None
    return value


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged


def _read(source: Mapping[str, Any] | str | os.PathLike[str] | None, environ: Mapping[str, str] | None,
          overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The merged, not yet validated settings of ``source``, the environment and ``overrides``."""
    env = os.environ if environ is None else environ
    if source is None and env.get(CONFIG_FILE_VAR):
        source = env[CONFIG_FILE_VAR]
    if source is None:
        data: dict[str, Any] = {}
    elif isinstance(source, Mapping):
        data = dict(source)
    else:
        path = Path(source)
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read configuration file {path}: {exc}") from None
        if not isinstance(loaded, Mapping):
            raise ConfigError(f"configuration file {path} must hold a mapping, got {type(loaded).__name__}")
        data = dict(loaded)
    return _merge(_merge(data, _env_overrides(env)), overrides or {})


def _validate(data: Mapping[str, Any]) -> EngineConfig:
    try:
        return EngineConfig.model_validate(data)
    except ValidationError as exc:
        raise _error(exc) from None


def load_config(
    source: EngineConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> EngineConfig:
    """Build an :class:`EngineConfig` from a dict, a YAML path or nothing, plus the environment, plus
    ``overrides`` (a command's explicit arguments, which the environment never overrides).

    An :class:`EngineConfig` is returned as it is (it was resolved already; ``overrides`` then raise).
    Pass ``environ={}`` to ignore the process environment.
    """
    if isinstance(source, EngineConfig):
        if overrides:
            raise ConfigError("overrides apply to a dict or file source, not to a resolved EngineConfig")
        return source
    return _validate(_read(source, environ, overrides))


#: ``chunk_size`` value asking an integration to derive the chunk size from its engine's block size.
AUTO_CHUNK = "auto"


def load_config_auto_chunk(
    source: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> tuple[EngineConfig, int | None]:
    """As :func:`load_config`, for integrations that derive the chunk size from the inference
    engine's block or page size, which only that engine knows (and which differs by platform).

    Returns the configuration and the explicitly requested chunk size, or None when ``chunk_size``
    is unset or ``"auto"`` (the configuration then holds the default until the integration resolves it).
    """
    data = _read(source, environ)
    requested = data.pop("chunk_size", AUTO_CHUNK)
    if requested is None or requested == AUTO_CHUNK:
        return _validate(data), None
    _validate(data)  # errors elsewhere in the config first, as load_config would report them
    try:
        config = _validate({**data, "chunk_size": requested})
    except ConfigError as exc:
        raise ConfigError(f"{exc} (or {AUTO_CHUNK!r}: derived from the inference engine's block size)") from None
    return config, config.chunk_size

"""The connector's settings, read once from ``kv_connector_extra_config``.

Keys (everything else is refused with :class:`~kvengine.errors.ConfigError`):

* ``kvengine`` -- the :class:`~kvengine.config.EngineConfig` of the worker's
  cache engine: a dict or a YAML path. ``KVENGINE_*`` environment variables
  override it, as everywhere in kvengine. ``chunk_size`` is ``"auto"`` by
  default: derived from the block sizes vLLM chose (see
  :func:`~.layout.resolve_chunk_size`); an explicit value must be a multiple
  of every KV cache group's block size, or the connector refuses to start.
* ``model_fingerprint`` -- the model's identity, when you manage versions
  yourself: replaces the content digest of the weight files (by default
  every byte of every weight file is hashed, see :mod:`kvengine.trust.weights`).
  Change it whenever the weights change, or stale KV is served.
* ``verification`` -- where the worker looks for a verification record
  when vLLM picked an attention backend this tree has not validated (the GPU
  backends, :data:`~.layout.PROVABLE_BACKENDS`): ``records`` (directory,
  default ``~/.cache/kvengine/verifications``, where ``kvengine verify vllm``
  writes), ``secret_file`` (records must be sealed with its secret), and
  ``serve_unverified_backend_risking_wrong_outputs`` (default false): serve on
  such a backend without a record, logged loudly at start-up
  (:mod:`.acceptance`).
* ``handoff`` -- a prefill instance's (``kv_role: kv_producer``, :mod:`.handoff`)
  server for decode instances: ``listen`` (``host:port``, required for a
  producer; port 0: any free port), ``advertise`` (the address consumers
  dial, default ``listen``), ``tls_cert`` / ``tls_key`` (PEM: TLS on). Records
  are sealed with ``kvengine.peers.secret_file``, required off loopback.
* ``lookup_wait_ms`` -- the longest the scheduler waits for the worker's first
  word on a new lookup (its answer from memory, or "pending" when it must
  promote from disk or peers) before it tells vLLM "not known yet" (``None``:
  vLLM asks again next step, and that ask does not wait). Default 2: a bound
  for a worker slow to answer at all; a healthy one answers in one round trip.

Every tier codec must be known to this process and lossless: vLLM loads the
stored pages as they are, so a lossy codec would serve other KV than vLLM
computed (refused here, before any engine starts, rather than when the worker
binds its namespace).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvengine.addresses import offset_port, split_host_port
from kvengine.config import EngineConfig, load_config_auto_chunk
from kvengine.errors import ConfigError
from kvengine.trust.verification import DEFAULT_RECORDS_DIR

_KEYS = ("handoff", "kvengine", "lookup_wait_ms", "model_fingerprint", "verification")
#: a consumer's default handoff.fetch_timeout (seconds)
DEFAULT_FETCH_TIMEOUT_S = 30.0
_HANDOFF_KEYS = ("advertise", "curve_allow", "fetch_timeout", "listen", "tls_cert", "tls_key")
_VERIFICATION_KEYS = ("records", "secret_file", "serve_unverified_backend_risking_wrong_outputs")


def _check_section(raw: Any, section: str, keys: tuple[str, ...]) -> None:
    """:raises ConfigError: ``raw`` is not a mapping, or has a key not in ``keys`` (named)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"kv_connector_extra_config['{section}'] must be a mapping")
    unknown = sorted(set(raw) - set(keys))
    if unknown:
        raise ConfigError(f"unknown kv_connector_extra_config['{section}'] keys {unknown} (allowed: {list(keys)})")


def _paths(raw: Mapping[str, Any], section: str, keys: tuple[str, ...]) -> dict[str, Path | None]:
    """``raw``'s ``keys`` as paths (None where unset). :raises ConfigError: one is not a path (named)."""
    paths = {}
    for key in keys:
        value = raw.get(key)
        if value is not None and (not isinstance(value, (str, os.PathLike)) or not str(value)):
            raise ConfigError(f"{section}.{key} must be a path, got {value!r}")
        paths[key] = None if value is None else Path(value).expanduser()
    return paths


@dataclass(frozen=True, slots=True, kw_only=True)
class VerificationOptions:
    """Where records that unlock a backend not validated in-tree are found, and the opt-in that skips them."""

    records: Path = DEFAULT_RECORDS_DIR
    secret_file: Path | None = None
    #: serve on an unvalidated backend without a matching record (the name is the risk)
    serve_unverified_backend_risking_wrong_outputs: bool = False

    @classmethod
    def from_extra(cls, raw: Any) -> VerificationOptions:
        """:raises ConfigError: not a mapping, an unknown key, or a mistyped value (each named)."""
        if raw is None:
            return cls()
        _check_section(raw, "verification", _VERIFICATION_KEYS)
        paths = _paths(raw, "verification", ("records", "secret_file"))
        risk = raw.get("serve_unverified_backend_risking_wrong_outputs", False)
        if not isinstance(risk, bool):
            raise ConfigError(f"verification.serve_unverified_backend_risking_wrong_outputs must be true or false, "
                              f"got {risk!r}")
        return cls(records=paths["records"] or DEFAULT_RECORDS_DIR, secret_file=paths["secret_file"],
                   serve_unverified_backend_risking_wrong_outputs=risk)


@dataclass(frozen=True, slots=True, kw_only=True)
class HandoffOptions:
    """A producer's server for consumers, and a consumer's wait for what it hands off (:mod:`.handoff`)."""

    listen: str | None = None
    #: the address consumers dial (None: ``listen``)
    advertise: str | None = None
    #: TLS of a producer's server on the tcp wire (consumers set ``peers.tls_ca``)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    #: CURVE public keys (Z85) of the consumers a producer's server admits on the zmq wire (its own keys:
    #: ``peers.curve_public_key`` / ``curve_secret_key``); required there off loopback
    curve_allow: tuple[str, ...] = ()
    #: a consumer's seconds to read a handed-off prompt's chunks, then its tail, in place of the peers'
    #: ``read_deadline`` and ``request_timeout`` (tuned for a cache's reads, whose miss costs little): a
    #: handed-off prompt is read whole or prefilled again, whatever its size. Past it: a failed load.
    fetch_timeout: float = DEFAULT_FETCH_TIMEOUT_S

    def __post_init__(self) -> None:
        if not 0 < self.fetch_timeout <= 3600:
            raise ConfigError(f"handoff.fetch_timeout must be in (0, 3600] seconds, got {self.fetch_timeout!r}")

    @classmethod
    def from_extra(cls, raw: Any) -> HandoffOptions:
        """:raises ConfigError: not a mapping, an unknown key, or a malformed value (each named)."""
        if raw is None:
            return cls()
        _check_section(raw, "handoff", _HANDOFF_KEYS)
        for key in ("listen", "advertise"):
            value = raw.get(key)
            if value is None:
                continue
            if not isinstance(value, str):
                raise ConfigError(f"handoff.{key} must be 'host:port', got {value!r}")
            try:
                split_host_port(value, any_port=key == "listen")  # consumers dial the advertised address
            except ConfigError as exc:
                raise ConfigError(f"handoff.{key} must be 'host:port': {exc}") from None
        timeout = raw.get("fetch_timeout", DEFAULT_FETCH_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise ConfigError(f"handoff.fetch_timeout must be a number of seconds, got {timeout!r}")
        allow = raw.get("curve_allow", ())
        if isinstance(allow, str) or not isinstance(allow, Sequence) or \
                not all(isinstance(k, str) and len(k) == 40 for k in allow):
            raise ConfigError(f"handoff.curve_allow must be a list of CURVE public keys (40-character Z85 strings, "
                              f"zmq.curve_keypair()), got {allow!r}")
        return cls(listen=raw.get("listen"), advertise=raw.get("advertise"), fetch_timeout=float(timeout),
                   curve_allow=tuple(allow), **_paths(raw, "handoff", ("tls_cert", "tls_key")))


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectorOptions:
    #: The cache engine's settings; its ``chunk_size`` is final only after :meth:`with_chunk_size`.
    engine: EngineConfig
    #: The requested chunk size (None: "auto", derived from vLLM's block sizes).
    chunk_size: int | None = None
    lookup_wait_s: float = 0.002
    #: An explicit model identity (None: the content digest of the weight files).
    model_fingerprint: str | None = None
    verification: VerificationOptions = field(default_factory=VerificationOptions)
    handoff: HandoffOptions = field(default_factory=HandoffOptions)

    def __post_init__(self) -> None:
        if not 0 < self.lookup_wait_s <= 60:
            raise ConfigError(f"lookup_wait_ms must be in (0, 60000], got {self.lookup_wait_s * 1000:g}")
        if self.engine.store_partial_chunks:
            raise ConfigError("kvengine.store_partial_chunks must be false with vLLM: chunks are whole KV blocks")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorOptions:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(_KEYS))
        if unknown:
            raise ConfigError(f"unknown kv_connector_extra_config keys {unknown} (allowed: {list(_KEYS)})")
        source = extra.get("kvengine")
        if source is not None and not isinstance(source, (Mapping, str, os.PathLike)):
            raise ConfigError("kv_connector_extra_config['kvengine'] must be a mapping or a YAML path")
        wait_ms = extra.get("lookup_wait_ms", 2)
        try:
            wait_s = float(wait_ms) / 1000
        except (TypeError, ValueError):
            raise ConfigError(f"lookup_wait_ms must be a number, got {wait_ms!r}") from None
        fingerprint = extra.get("model_fingerprint")
        if fingerprint is not None and (not isinstance(fingerprint, str) or not fingerprint):
            raise ConfigError(f"model_fingerprint must be a non-empty string, got {fingerprint!r}")
        verification = VerificationOptions.from_extra(extra.get("verification"))
        handoff = HandoffOptions.from_extra(extra.get("handoff"))
        engine, chunk_size = load_config_auto_chunk(source)
        check_codecs(engine)
        return cls(engine=engine, chunk_size=chunk_size, lookup_wait_s=wait_s, model_fingerprint=fingerprint,
                   verification=verification, handoff=handoff)

    def for_rank(self, rank: int, world_size: int, *, handoff: bool = False) -> ConnectorOptions:
        """These options for tensor-parallel rank ``rank`` of ``world_size`` (>1): each rank's engine gets
        its own disk directory under ``disk.path`` (one writer per directory) and metrics port
        (``metrics_port + rank``); only rank 0 publishes KV events. ``handoff`` (a producer or consumer):
        rank r of a producer serves on ``handoff.listen`` / ``advertise`` port + r, and rank r of a consumer
        reads from its ``peers``' port + r, the producers' rank r (the same shard)."""
        if world_size == 1:
            return self
        engine = self.engine.model_dump()
        handoff_options = self.handoff
        if handoff and rank:
            engine["peers"]["peers"] = [offset_port(a, rank) for a in self.engine.peers.peers]
            listen, advertise = self.handoff.listen, self.handoff.advertise
            handoff_options = replace(self.handoff, listen=listen and offset_port(listen, rank),
                                      advertise=advertise and offset_port(advertise, rank))
        if self.engine.disk.path is not None:
            base = self.engine.disk.path
            if base.parent.is_dir():  # a missing parent (mount) is refused by the disk tier, as for one rank
                base.mkdir(exist_ok=True)
            engine["disk"]["path"] = base / f"tp{rank}-of-{world_size}"
        if self.engine.metrics_port:
            engine["metrics_port"] = self.engine.metrics_port + rank
        if rank > 0:  # every rank stores the same prompts' chunks: rank 0's KV events tell a router all of it
            engine["events"]["endpoint"] = engine["events"]["replay_endpoint"] = None
        return replace(self, engine=EngineConfig.model_validate(engine), handoff=handoff_options)

    def with_chunk_size(self, chunk_size: int) -> ConnectorOptions:
        """These options with the chunk size resolved against vLLM's block sizes."""
        engine = EngineConfig.model_validate({**self.engine.model_dump(), "chunk_size": chunk_size})
        return replace(self, engine=engine, chunk_size=chunk_size)


def check_codecs(engine: EngineConfig) -> None:
    """Refuse a tier codec this process does not know, or a lossy one (the connector serves exact KV only)."""
    from kvengine.compression import default_codecs

    named = [("disk.codec", engine.disk.codec), ("peers.codec", engine.peers.codec),
             ("mooncake.codec", engine.mooncake.codec)]
    named += [(f"tiers[{i}].codec", tier.codec) for i, tier in enumerate(engine.tiers)]
    registry = default_codecs(threads=1)
    for where, name in named:
        try:
            codec = registry.by_name(name)
        except ValueError as exc:
            raise ConfigError(f"kvengine vLLM connector: kvengine.{where}: {exc}") from None
        if not codec.lossless:
            raise ConfigError(f"kvengine vLLM connector: kvengine.{where}={name!r} is lossy: vLLM loads stored pages "
                              "as they are, so the connector serves exact KV only; use a lossless codec "
                              "(raw, lz4-*, zstd-*)")

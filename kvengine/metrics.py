"""Prometheus metrics of one engine instance (its own registry, no globals)."""

from __future__ import annotations

import logging
import re
import threading
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol, runtime_checkable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvengine.errors import INTEGRITY_REASONS, ConfigError, IntegrityReason
from kvengine.transport import ChunkTransport, ReportsStats

logger = logging.getLogger("kvengine")

#: Latency histogram buckets, in seconds: a resident lookup takes microseconds, a promotion from a
#: remote peer or a store of a long prompt can take seconds.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0, float("inf"))

#: Tier calls counted in ``kvengine_tier_errors_total{op}`` (present at 0 per lower tier from the start).
TIER_OPS = ("exists", "get", "delete")


@runtime_checkable
class ReportsCallFailures(Protocol):
    """Optional part of a tier's ``stats()``: calls it answered with a default (a miss) instead of raising,
    by op (``exists``, ``get``, ``delete``), e.g. a read past its deadline. Exported with the calls that
    raised, in ``kvengine_tier_errors_total{tier,op}``."""

    @property
    def call_failures(self) -> Mapping[str, int]: ...


class MemoryGauges(Protocol):
    """What the metrics read of the memory tier (:class:`kvengine.core.memory_tier.MemoryTier`)."""

    @property
    def capacity_bytes(self) -> int: ...
    @property
    def used_bytes(self) -> int: ...
    def __len__(self) -> int: ...


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self._logged: set[str] = set()
        self._lock = threading.Lock()
        self._tiers: list[str] = ["memory"]  # every tier named so far (per-model store series per tier)
        self._models: set[str] = set()  # every model seeded so far
        r = self.registry
        # Per-request families carry the bound model's name (``Namespace.model``); their series are created
        # at 0 when a model is bound (:meth:`seed_model`). Totals: sum over ``model``.
        m = ["model"]
        self.lookups = Counter("kvengine_lookups", "Distinct lookups (repeats of a live reservation excluded)", m,
                               registry=r)
        self.lookup_tokens = Counter("kvengine_lookup_tokens", "Tokens asked for by distinct lookups", m, registry=r)
        self.hit_tokens = Counter("kvengine_hit_tokens", "Tokens promised by distinct lookups", m, registry=r)
        self.tail_hit_tokens = Counter("kvengine_tail_hit_tokens", "Tokens of hits past the last whole chunk, up "
                                       "to a whole block (tails: kvengine.core.tails)", m, registry=r)
        self.loaded_tokens = Counter("kvengine_loaded_tokens", "Tokens delivered by loads", m, registry=r)
        self.approximate_tokens = Counter("kvengine_reused_tokens_approximate", "Segment tokens blended into a "
                                          "prompt without attending to what precedes them (never exact reuse)", m,
                                          registry=r)
        self.load_failed_tokens = Counter("kvengine_load_failed_tokens", "Promised tokens a load could not deliver",
                                          m, registry=r)
        self.stored_bytes = Counter("kvengine_stored_bytes", "Bytes written per tier and model", ["tier", "model"],
                                    registry=r)
        self.loaded_bytes = Counter("kvengine_loaded_bytes", "Bytes read per tier", ["tier"], registry=r)
        self.unused_read_bytes = Counter("kvengine_unused_read_bytes", "Bytes lookups read from lower tiers into "
                                         "memory for reservations that ended without a load (a hit the caller "
                                         "did not take)", registry=r)
        self.tails_superseded = Counter("kvengine_tails_superseded", "Tails discarded from memory when their "
                                        "chunk was stored further (a longer tail, or the whole chunk)", registry=r)
        self.stored_chunks = Counter("kvengine_stored_chunks", "Chunks written per tier and model", ["tier", "model"],
                                     registry=r)
        self.store_rejected = Counter("kvengine_store_rejected", "Chunks not stored", ["reason"], registry=r)
        self.reservations_active = Gauge("kvengine_reservations_active", "Live reservations", registry=r)
        self.reservations_reclaimed = Counter("kvengine_reservations_reclaimed", "Reservations reclaimed after their lease", registry=r)
        self.writes_dropped = Counter("kvengine_writes_dropped", "Background writes dropped", ["reason"], registry=r)
        self.abandoned = Counter("kvengine_abandoned", "Loads and staged stores left unfinished for 10 leases, "
                                 "their pins dropped", ["op"], registry=r)
        self.write_waits = Counter("kvengine_write_waits", "Stores that waited for room in the tier write queue "
                                   "(write_behind backpressure)", registry=r)
        self.namespace_changes = Counter("kvengine_namespace_changes",
                                         "Attached models whose weights changed, moved to a new namespace",
                                         registry=r)
        self.quarantined = Gauge("kvengine_quarantined_namespaces", "Namespace roots whose stored KV is never served",
                                 registry=r)
        self.quarantine_refusals = Counter("kvengine_quarantine_refusals",
                                           "Lookups, stores and keyed ops refused: namespace quarantined", ["op"],
                                           registry=r)
        self.provenance_checks = Counter(
            "kvengine_provenance_checks",
            "Stored KV compared with what the reading model computes (check: canary, shadow; outcome: exact, "
            "close = within the dtype's tolerance, mismatch = quarantined, written = first writer's canary, "
            "skipped = a shadowed hit with no chunk left to compare)",
            ["check", "outcome"], registry=r)
        for check, outcomes in (("canary", ("exact", "close", "mismatch", "written")),
                                ("shadow", ("exact", "close", "mismatch", "skipped"))):
            for outcome in outcomes:  # present from the start, so an alert on them sees a 0 first
                self.provenance_checks.labels(check=check, outcome=outcome)
        # Latency of the engine's operations, and of each lower tier's share of them.
        self.lookup_seconds = Histogram("kvengine_lookup_seconds", "Lookup latency (memory, and any promotion "
                                        "from lower tiers)", m, buckets=LATENCY_BUCKETS, registry=r)
        self.load_seconds = Histogram("kvengine_load_seconds", "Load latency, begin_load to finish_load (the "
                                      "caller's copies included)", m, buckets=LATENCY_BUCKETS, registry=r)
        self.store_seconds = Histogram("kvengine_store_seconds", "Store latency, until the call returns (in "
                                       "memory and queued for the tiers, or written through)",
                                       m, buckets=LATENCY_BUCKETS, registry=r)
        self.tier_read_seconds = Histogram("kvengine_tier_read_seconds", "Promotions from a lower tier within a "
                                           "lookup (exists, reads, verification, copy into memory)", ["tier"],
                                           buckets=LATENCY_BUCKETS, registry=r)
        self.tier_write_seconds = Histogram("kvengine_tier_write_seconds", "Writes of one record to a lower tier",
                                            ["tier"], buckets=LATENCY_BUCKETS, registry=r)
        # Counted here and merged by TierStatsCollector with what the lower tiers count themselves: one
        # family per concept, labelled by tier (the engine's own registry never exports these three).
        self._own = CollectorRegistry(auto_describe=True)
        self.tier_errors = Counter("kvengine_tier_errors", "Tier calls that failed (served as misses)", ["tier", "op"],
                                   registry=self._own)
        self.evictions = Counter("kvengine_evictions", "Chunks evicted per tier", ["tier"], registry=self._own)
        self.integrity_failures = Counter("kvengine_integrity_failures", "Records that failed verification",
                                          ["tier", "reason"], registry=self._own)
        for tier in ("memory",):  # present from the start, so a dashboard never shows "no data"
            self._seed_tier(tier)
        self.store_rejected.labels(reason="no_room")
        for reason in ("shutdown", "encode_failed"):
            self.writes_dropped.labels(reason=reason)
        for op in ("load", "store"):
            self.abandoned.labels(op=op)
        for op in ("lookup", "store"):
            self.quarantine_refusals.labels(op=op)
        self._tier_stats = TierStatsCollector(self)
        r.register(self._tier_stats)

    def seed_model(self, model: str) -> None:
        """Create ``model``'s series of the per-request families at 0 (called when a model is bound)."""
        with self._lock:
            self._models.add(model)
            tiers = list(self._tiers)
        for family in (self.lookups, self.lookup_tokens, self.hit_tokens, self.tail_hit_tokens, self.loaded_tokens,
                       self.load_failed_tokens, self.approximate_tokens, self.lookup_seconds, self.load_seconds,
                       self.store_seconds):
            family.labels(model=model)
        for tier in tiers:
            self.stored_bytes.labels(tier=tier, model=model)
            self.stored_chunks.labels(tier=tier, model=model)

    def _seed_tier(self, tier: str) -> None:
        with self._lock:
            if tier not in self._tiers:
                self._tiers.append(tier)
            models = sorted(self._models)
        for model in models:
            self.stored_bytes.labels(tier=tier, model=model)
            self.stored_chunks.labels(tier=tier, model=model)
        self.loaded_bytes.labels(tier=tier)
        if tier == "memory":
            self.evictions.labels(tier=tier)
            return
        self.writes_dropped.labels(reason=f"{tier}_failed")
        self.tier_read_seconds.labels(tier=tier)
        self.tier_write_seconds.labels(tier=tier)
        for op in TIER_OPS:
            self.tier_errors.labels(tier=tier, op=op)

    def watch_memory(self, memory: MemoryGauges) -> None:
        """Export the memory tier's chunks, used and capacity bytes (``kvengine_tier_*{tier="memory"}``)."""
        self._tier_stats.memory = memory

    def watch_tiers(self, transports: Sequence[ChunkTransport]) -> None:
        """Export the lower tiers' own counters and gauges; their labelled series start at 0."""
        self._tier_stats.transports = [(t.name, t) for t in transports if isinstance(t, ReportsStats)]
        self._tier_stats.tiers = [t.name for t in transports]
        for transport in transports:
            self._seed_tier(transport.name)

    def own_samples(self, family: str) -> Iterator[tuple[dict[str, str], float]]:
        """(labels, value) of each ``_total`` sample of a family counted by the engine itself."""
        for metric in self._own.collect():
            if metric.name == family:
                for sample in metric.samples:
                    if sample.name == f"{family}_total":
                        yield sample.labels, sample.value

    def value(self, name: str, **labels: str) -> float:
        """Current value of a sample (``name`` as exported, e.g. ``kvengine_hit_tokens_total``), summed over
        the samples whose labels include ``labels`` (all of a family's samples when none are given)."""
        total = 0.0
        for metric in self.registry.collect():
            for sample in metric.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
        return total

    def integrity_failure(self, reason: IntegrityReason, detail: str, *, tier: str) -> None:
        """Count a verification failure of a record read from ``tier``; log each reason once per engine."""
        self.integrity_failures.labels(tier=tier, reason=reason).inc()
        self.log_once(f"integrity:{reason}", "cache integrity failure (%s): %s; served as a miss", reason, detail)

    def log_once(self, tag: str, msg: str, *args: object) -> None:
        with self._lock:
            if tag in self._logged:
                return
            self._logged.add(tag)
        logger.warning(msg, *args)

    def serve_http(self, port: int, host: str = "127.0.0.1") -> Callable[[], None]:
        """Export this registry over HTTP on ``host:port``; returns the function that stops it."""
        return serve_registry(self.registry, port, host)


def serve_registry(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> Callable[[], None]:
    """Export ``registry`` over HTTP on ``host:port``; returns the function that stops it.

    :raises ConfigError: the address cannot be bound (naming ``metrics_port`` / ``metrics_host``).
    """
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ConfigError(f"metrics_port {port} on metrics_host {host!r} cannot be bound: {exc}") from None

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return stop


def scrape(port: int, host: str = "127.0.0.1", *, timeout: float = 10.0) -> dict[str, float]:
    """The kvengine samples an engine serves on ``metrics_port`` (e.g. inside a vLLM worker
    process), keyed as exposed: ``'kvengine_loaded_bytes_total{tier="local_disk"}'``."""
    return scrape_url(f"http://{host}:{port}/metrics", timeout=timeout)


def scrape_url(url: str, *, timeout: float = 10.0) -> dict[str, float]:
    """:func:`scrape` of a full metrics URL (``http://host:port/metrics``).

    :raises OSError: the endpoint cannot be reached (``urllib.error.URLError`` is one).
    """
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return parse_samples(reply.read().decode())


#: Labels that split a per-request family into series whose sum is the family's total (see :func:`parse_samples`).
SUMMED_LABELS = ("model",)

_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_key(key: str) -> tuple[str, dict[str, str]]:
    """A sample's key as exposed, split: ``'kvengine_x_total{tier="memory"}'`` ->
    ``('kvengine_x_total', {'tier': 'memory'})`` (label values unescaped)."""
    name, brace, rest = key.partition("{")
    if not brace:
        return name, {}
    labels = {k: v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
              for k, v in _LABEL.findall(rest.rstrip("}"))}
    return name, labels

#: Samples each family type exposes unlabelled when summed over nothing (a family with no series yet).
_EMPTY_SAMPLES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_count", "_sum")}


def parse_samples(text: str) -> dict[str, float]:
    """The ``kvengine*`` samples of a Prometheus text exposition, keyed as exposed
    (``'kvengine_loaded_bytes_total{tier="local_disk"}'``), and totals keyed as before labels split them:

    * the bare sample name (``kvengine_hit_tokens_total``, ``kvengine_lookup_seconds_count``) of every
      labelled sample, mapped to the sum over that name's samples (not for ``_bucket`` / ``_created``);
    * each labelled key with the ``model`` label dropped (``'kvengine_stored_chunks_total{tier="memory"}'``,
      ``'kvengine_lookup_seconds_bucket{le="0.001"}'``), mapped to the sum over models;
    * a declared family with no series yet (a per-model family before any model is bound): its
      unlabelled samples at 0.

    A key the exposition itself has is never replaced.
    """
    samples: dict[str, float] = {}
    declared: dict[str, str] = {}  # family -> type, of families with no sample (yet)
    family = ""
    for line in text.splitlines():
        if line.startswith("# TYPE kvengine"):
            parts = line.split()
            family = parts[2]
            declared[family] = parts[3] if len(parts) > 3 else ""
        elif line.startswith("kvengine"):
            key, raw = line.rsplit(" ", 1)
            samples[key] = float(raw)
            declared.pop(family, None)
    derived: dict[str, float] = {}
    for key, value in samples.items():
        name, brace, rest = key.partition("{")
        if not brace or name.endswith("_created"):
            continue
        if not name.endswith("_bucket"):
            derived[name] = derived.get(name, 0.0) + value
        labels = _LABEL.findall(rest)
        kept = [(k, v) for k, v in labels if k not in SUMMED_LABELS]
        if kept and len(kept) < len(labels):
            total = name + "{" + ",".join(f'{k}="{v}"' for k, v in kept) + "}"
            derived[total] = derived.get(total, 0.0) + value
    for family, kind in declared.items():
        base = family.removesuffix("_total") if kind == "counter" else family  # TYPE names either spelling
        for suffix in _EMPTY_SAMPLES.get(kind, ()):
            derived.setdefault(base + suffix, 0.0)
    for key, value in derived.items():
        samples.setdefault(key, value)
    return samples


class TierStatsCollector(Collector):
    """Exports what the tiers report themselves (their size, and faults they absorb as misses), merged
    with what the engine counts of them: one family per concept, labelled by tier."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self.metrics = metrics
        self.memory: MemoryGauges | None = None
        self.transports: list[tuple[str, ReportsStats]] = []
        self.tiers: list[str] = []  # every lower tier's name, reporting stats or not

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        chunks = GaugeMetricFamily("kvengine_tier_chunks", "Chunks held per tier", labels=["tier"])
        used = GaugeMetricFamily("kvengine_tier_used_bytes", "Bytes used per tier", labels=["tier"])
        capacity = GaugeMetricFamily("kvengine_tier_capacity_bytes", "Capacity per tier (where the tier has one)",
                                     labels=["tier"])
        puts = CounterMetricFamily("kvengine_tier_put_failures", "Writes a tier refused (reason \"\": none yet)",
                                   labels=["tier", "reason"])
        evicted: dict[str, float] = {labels["tier"]: v for labels, v in self.metrics.own_samples("kvengine_evictions")}
        corrupt: dict[tuple[str, str], float] = {(tier, reason): 0.0 for tier in self.tiers
                                                 for reason in sorted(INTEGRITY_REASONS)}
        for labels, v in self.metrics.own_samples("kvengine_integrity_failures"):
            key = (labels["tier"], labels["reason"])
            corrupt[key] = corrupt.get(key, 0.0) + v
        faults: dict[tuple[str, str], float] = {(labels["tier"], labels["op"]): v
                                                for labels, v in self.metrics.own_samples("kvengine_tier_errors")}
        if self.memory is not None:
            chunks.add_metric(["memory"], len(self.memory))
            used.add_metric(["memory"], self.memory.used_bytes)
            capacity.add_metric(["memory"], self.memory.capacity_bytes)
        for tier, transport in self.transports:
            stats = transport.stats()
            chunks.add_metric([tier], stats.chunks)
            used.add_metric([tier], stats.used_bytes)
            tier_capacity = getattr(stats, "capacity_bytes", None)
            if tier_capacity is not None:
                capacity.add_metric([tier], tier_capacity)
            evicted[tier] = evicted.get(tier, 0.0) + stats.evictions
            for reason, n in stats.integrity_reasons.items():
                corrupt[(tier, reason)] = corrupt.get((tier, reason), 0.0) + n
            for reason, refused in (stats.put_failures or {"": 0}).items():
                puts.add_metric([tier, reason], refused)
            if isinstance(stats, ReportsCallFailures):
                for op, n in stats.call_failures.items():
                    faults[(tier, op)] = faults.get((tier, op), 0.0) + n
        evictions = CounterMetricFamily("kvengine_evictions", "Chunks evicted per tier", labels=["tier"])
        for tier, count in evicted.items():
            evictions.add_metric([tier], count)
        integrity = CounterMetricFamily("kvengine_integrity_failures", "Records that failed verification (found "
                                        "by the engine or by the tier itself), served as misses",
                                        labels=["tier", "reason"])
        for (tier, reason), count in sorted(corrupt.items()):
            integrity.add_metric([tier, reason], count)
        errors = CounterMetricFamily("kvengine_tier_errors", "Tier calls that failed, served as misses (those that "
                                     "raised, and those the tier answered with a miss itself, e.g. past its "
                                     "deadline)", labels=["tier", "op"])
        for (tier, op), count in sorted(faults.items()):
            errors.add_metric([tier, op], count)
        yield from (chunks, used, capacity, evictions, integrity, puts, errors)

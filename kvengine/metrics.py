"""Prometheus metrics of one engine instance (its own registry, no globals)."""

from __future__ import annotations

import logging
import threading
import urllib.request
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvengine.errors import ConfigError, IntegrityReason
from kvengine.transport import ChunkTransport, ReportsStats

logger = logging.getLogger("kvengine")


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.lookups = Counter("kvengine_lookups", "Distinct lookups (repeats of a live reservation excluded)", registry=r)
        self.lookup_tokens = Counter("kvengine_lookup_tokens", "Tokens asked for by distinct lookups", registry=r)
        self.hit_tokens = Counter("kvengine_hit_tokens", "Tokens promised by distinct lookups", registry=r)
        self.loaded_tokens = Counter("kvengine_loaded_tokens", "Tokens delivered by loads", registry=r)
        self.load_failed_tokens = Counter("kvengine_load_failed_tokens", "Promised tokens a load could not deliver", registry=r)
        self.stored_bytes = Counter("kvengine_stored_bytes", "Bytes written per tier", ["tier"], registry=r)
        self.loaded_bytes = Counter("kvengine_loaded_bytes", "Bytes read per tier", ["tier"], registry=r)
        self.stored_chunks = Counter("kvengine_stored_chunks", "Chunks written per tier", ["tier"], registry=r)
        self.evictions = Counter("kvengine_evictions", "Chunks evicted per tier", ["tier"], registry=r)
        self.store_rejected = Counter("kvengine_store_rejected", "Chunks not stored", ["reason"], registry=r)
        self.reservations_active = Gauge("kvengine_reservations_active", "Live reservations", registry=r)
        self.reservations_reclaimed = Counter("kvengine_reservations_reclaimed", "Reservations reclaimed after their lease", registry=r)
        self.integrity_failures = Counter("kvengine_integrity_failures", "Records that failed verification", ["reason"], registry=r)
        self.writes_dropped = Counter("kvengine_writes_dropped", "Background writes dropped", ["reason"], registry=r)
        self.abandoned = Counter("kvengine_abandoned", "Loads and staged stores left unfinished for 10 leases, "
                                 "their pins dropped", ["op"], registry=r)
        self.write_waits = Counter("kvengine_write_waits", "Stores that waited for room in the tier write queue "
                                   "(write_behind backpressure)", registry=r)
        self.tier_errors = Counter("kvengine_tier_errors", "Tier calls that failed (served as misses)", ["tier", "op"],
                                   registry=r)
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
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def value(self, name: str, **labels: str) -> float:
        """Current value of a sample (``name`` as exported, e.g. ``kvengine_hit_tokens_total``)."""
        v = self.registry.get_sample_value(name, labels or None)
        return 0.0 if v is None else v

    def integrity_failure(self, reason: IntegrityReason, detail: str) -> None:
        """Count a verification failure; log each reason once per engine."""
        self.integrity_failures.labels(reason=reason).inc()
        self.log_once(f"integrity:{reason}", "cache integrity failure (%s): %s; served as a miss", reason, detail)

    def log_once(self, tag: str, msg: str, *args: object) -> None:
        with self._lock:
            if tag in self._logged:
                return
            self._logged.add(tag)
        logger.warning(msg, *args)

    def serve_http(self, port: int, host: str = "127.0.0.1") -> Callable[[], None]:
        """Export this registry over HTTP on ``host:port``; returns the function that stops it.

        :raises ConfigError: the address cannot be bound (naming ``metrics_port`` / ``metrics_host``).
        """
        try:
            server, thread = start_http_server(port, addr=host, registry=self.registry)
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
    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout).read().decode()
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("kvengine"))
    return {name: float(value) for name, value in samples}


class TierStatsCollector(Collector):
    """Exports the counters that lower tiers keep themselves (faults they absorb as misses)."""

    def __init__(self, transports: Sequence[ChunkTransport]) -> None:
        self._transports = [t for t in transports if isinstance(t, ReportsStats)]

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        chunks = GaugeMetricFamily("kvengine_tier_chunks", "Chunks held per tier", labels=["tier"])
        used = GaugeMetricFamily("kvengine_tier_used_bytes", "Bytes used per tier", labels=["tier"])
        evictions = CounterMetricFamily("kvengine_tier_evictions", "Chunks evicted by a tier", labels=["tier"])
        integrity = CounterMetricFamily("kvengine_tier_integrity_failures",
                                        "Records a tier found corrupt and dropped", labels=["tier", "reason"])
        puts = CounterMetricFamily("kvengine_tier_put_failures", "Writes a tier refused", labels=["tier", "reason"])
        for transport in self._transports:
            stats = transport.stats()
            tier = transport.name
            chunks.add_metric([tier], stats.chunks)
            used.add_metric([tier], stats.used_bytes)
            evictions.add_metric([tier], stats.evictions)
            for reason, n in stats.integrity_reasons.items():
                integrity.add_metric([tier, reason], n)
            for reason, n in stats.put_failures.items():
                puts.add_metric([tier, reason], n)
        yield from (chunks, used, evictions, integrity, puts)

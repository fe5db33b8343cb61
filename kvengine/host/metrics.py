"""The host service's Prometheus metrics: each pool (tenant) and the connections' lifetimes.

Read from :meth:`~kvengine.host.service.HostService.stats` at each scrape (a
collector, not counters updated on the request path)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvengine.host.service import HostService, HostStats


class HostCollector(Collector):
    def __init__(self, stats: Callable[[], HostStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._stats()
        per_tenant = (
            ("kvengine_host_chunks", "Chunks resident in the tenant's pool", GaugeMetricFamily, "chunks"),
            ("kvengine_host_used_bytes", "Bytes of the tenant's pool in use", GaugeMetricFamily, "used_bytes"),
            ("kvengine_host_capacity_bytes", "The tenant's pool (its quota, or the shared rest)", GaugeMetricFamily,
             "capacity_bytes"),
            ("kvengine_host_evictions", "Chunks evicted from the tenant's pool", CounterMetricFamily, "evictions"),
        )
        for name, help_text, family, field in per_tenant:
            metric = family(name, help_text, labels=["tenant"])
            for tenant, pool in stats.pools.items():
                metric.add_metric([tenant], getattr(pool, field))
            yield metric
        yield GaugeMetricFamily("kvengine_host_connections", "Attached clients", value=stats.connections)
        yield GaugeMetricFamily("kvengine_host_pins", "Pins held by attached clients", value=stats.pins)
        for name, help_text, value in (
            ("kvengine_host_released_pins", "Pins released because their connection closed holding them",
             stats.released_pins),
            ("kvengine_host_aborted_stores", "Stores aborted because their connection closed before committing",
             stats.aborted_stores),
            ("kvengine_host_refused_connections", "Connections refused (a user not allowed)",
             stats.refused_connections),
        ):
            yield CounterMetricFamily(name, help_text, value=value)


def host_registry(service: HostService) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(HostCollector(service.stats))
    return registry

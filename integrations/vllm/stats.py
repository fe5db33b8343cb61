"""kvengine's counters in vLLM's own stats path (its log line and its Prometheus ``/metrics``).

vLLM 0.32 pulls connector stats with ``get_kv_connector_stats()`` each step,
in the worker (after ``wait_for_save``; carried to the engine core in
``KVConnectorOutput``) and in the scheduler (after ``update_connector_output``),
aggregates them there, and sends ``to_dict()`` to the main process with the
scheduler stats (only when stats are on: ``vllm serve``, or
``disable_log_stats=False``). There, ``build_kv_connector_stats(data)``
rebuilds a :class:`KVEngineStats` for the ``KV Transfer metrics:`` log line,
and the object ``build_prom_metrics`` returned is ``observe``\\ d to update
``vllm:kvengine_*`` counters and gauges in vLLM's Prometheus registry.

Payload: ``{"counters": {key: increase since the last report}, "gauges":
{key: current value}}``, plain numbers keyed by the names of :data:`COUNTERS`
and :data:`GAUGES` (``key:label`` for a labelled one, e.g.
``stored_chunks:memory``). The worker's counters are differences of the
cache engine's own cumulative metrics (:mod:`kvengine.metrics`), so vLLM's
totals equal kvengine's for the same run.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

#: vLLM counter name -> (kvengine sample it follows, label it is split by or None, documentation).
COUNTERS: dict[str, tuple[str, str | None, str]] = {
    "lookups": ("kvengine_lookups_total", None, "Distinct kvengine lookups"),
    "hit_tokens": ("kvengine_hit_tokens_total", None, "Tokens kvengine lookups promised"),
    "loaded_tokens": ("kvengine_loaded_tokens_total", None, "Tokens kvengine loaded into vLLM blocks"),
    "load_failed_tokens": ("kvengine_load_failed_tokens_total", None,
                           "Promised tokens a kvengine load could not deliver (recomputed by vLLM)"),
    "load_error_blocks": ("kvengine_vllm_load_error_blocks_total", None,
                          "Blocks kvengine reported to vLLM for recompute"),
    "stored_chunks": ("kvengine_stored_chunks_total", "tier", "Chunks kvengine wrote, per tier"),
    "loads": ("kvengine_vllm_loads_total", "outcome", "kvengine loads into vLLM blocks, per outcome"),
    "handoffs": ("kvengine_vllm_handoffs_total", "event",
                 "Prefill/decode handoffs: tails stored and loaded, holds confirmed by a consumer or expired"),
    # scheduler half
    "lookups_in_flight": ("", None, "Lookups whose answer was not back within lookup_wait_ms "
                                    "(vLLM was told 'not known yet' and asked again)"),
    "offered_tokens": ("", None, "External tokens the scheduler half offered vLLM (repeats included)"),
    "lookup_timeouts": ("", None, "Lookups the worker left unanswered past their deadline (the request read "
                                  "nothing from the cache)"),
    "refused_handoffs": ("", "reason", "Handed-off prompts a decode instance refused and computed itself, "
                                       "per reason"),
}
#: vLLM gauge name -> (kvengine sample, documentation).
GAUGES: dict[str, tuple[str, str]] = {
    "reservations_held": ("kvengine_vllm_reservations_held", "Reservations the kvengine worker holds"),
    "pinned_chunks": ("kvengine_vllm_pinned_chunks", "Pins on kvengine memory-tier chunks"),
}
LABELS = {name: label for name, (_, label, _) in COUNTERS.items() if label}


@dataclass
class KVEngineStats(KVConnectorStats):
    """kvengine's stats over an interval: counter increases are summed, gauges keep the latest value."""

    data: dict[str, Any] = field(default_factory=lambda: {"counters": {}, "gauges": {}})

    def __post_init__(self) -> None:
        self.data = {"counters": dict(self.data.get("counters", {})), "gauges": dict(self.data.get("gauges", {}))}

    def reset(self) -> None:
        self.data = {"counters": {}, "gauges": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        counters = self.data["counters"]
        for key, value in other.data.get("counters", {}).items():
            counters[key] = counters.get(key, 0) + value
        self.data["gauges"].update(other.data.get("gauges", {}))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for key, value in self.data["counters"].items():
            out[key] = out.get(key, 0) + value
        out.update(self.data["gauges"])
        return out

    def is_empty(self) -> bool:
        return not any(self.data["counters"].values()) and not self.data["gauges"]


def read_samples(registry: Any, names: Iterable[str]) -> dict[str, float]:
    """One pass over ``registry``: each wanted sample's value, keyed ``sample`` or ``sample:label`` (see
    :data:`COUNTERS`) and summed over other labels."""
    wanted = set(names)
    split = {sample: label for sample, label, _ in COUNTERS.values() if label}
    out: dict[str, float] = {}
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name not in wanted:
                continue
            label = split.get(sample.name)
            key = f"{sample.name}:{sample.labels.get(label, '')}" if label else sample.name
            out[key] = out.get(key, 0.0) + float(sample.value)
    return out


class WorkerStatsSource:
    """The worker half's ``get_kv_connector_stats``: increases of the engine's counters since its last report.

    Reads the registry after steps that loaded or stored, and at most once a second otherwise (disk
    writes finish in the background), so idle steps send nothing.
    """

    def __init__(self, registry: Any, *, idle_interval_s: float = 1.0) -> None:
        self._registry = registry
        self._idle = idle_interval_s
        self._last: dict[str, float] = {}
        self._gauges: dict[str, float] = {}
        self._read_at = 0.0
        self.dirty = False

    def take(self) -> KVEngineStats | None:
        now = time.monotonic()
        if not self.dirty and now - self._read_at < self._idle:
            return None
        self.dirty, self._read_at = False, now
        samples = [s for s, _, _ in COUNTERS.values() if s] + [s for s, _ in GAUGES.values()]
        current = read_samples(self._registry, samples)
        counters: dict[str, float] = {}
        for name, (sample, label, _) in COUNTERS.items():
            if not sample:
                continue
            for key, value in current.items():
                if key == sample or (label and key.startswith(f"{sample}:")):
                    increase = value - self._last.get(key, 0.0)
                    self._last[key] = value
                    if increase:
                        counters[name + key[len(sample):]] = increase
        gauges = {name: current.get(sample, 0.0) for name, (sample, _) in GAUGES.items()}
        changed = {k: v for k, v in gauges.items() if self._gauges.get(k) != v}
        self._gauges.update(changed)
        if not counters and not changed:
            return None
        return KVEngineStats({"counters": counters, "gauges": gauges})


class SchedulerStatsSource:
    """The scheduler half's ``get_kv_connector_stats``: increases of its :class:`~.scheduler.SchedulerStats`."""

    def __init__(self, stats: Any) -> None:
        self._stats = stats
        self._last: dict[str, float] = {}

    def take(self) -> KVEngineStats | None:
        counters = {}
        names = ("lookups_in_flight", "offered_tokens", "lookup_timeouts")
        values = {name: float(getattr(self._stats, name)) for name in names}
        values.update({f"refused_handoffs:{reason}": float(n) for reason, n in self._stats.refused_handoffs.items()})
        for name, value in values.items():
            increase = value - self._last.get(name, 0.0)
            self._last[name] = value
            if increase:
                counters[name] = increase
        return KVEngineStats({"counters": counters, "gauges": {}}) if counters else None


class KVEnginePromMetrics(KVConnectorPromMetrics):
    """``vllm:kvengine_<name>`` counters and gauges in vLLM's Prometheus registry, per engine."""

    def __init__(self, vllm_config: Any, metric_types: Mapping[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, Any] = {}
        self._gauges: dict[str, Any] = {}
        for name, (_, label, doc) in COUNTERS.items():
            self._counters[name] = self._counter_cls(
                name=f"vllm:kvengine_{name}", documentation=doc,
                labelnames=[*labelnames, label] if label else labelnames)
        for name, (_, doc) in GAUGES.items():
            self._gauges[name] = self._gauge_cls(name=f"vllm:kvengine_{name}", documentation=doc,
                                                 labelnames=labelnames, multiprocess_mode="mostrecent")

    def _labels(self, engine_idx: int) -> list[object]:
        return list(self.per_engine_labelvalues.get(engine_idx, [str(engine_idx)]))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self._labels(engine_idx)
        for key, value in transfer_stats_data.get("counters", {}).items():
            name, _, label_value = key.partition(":")
            counter = self._counters.get(name)
            if counter is None or value <= 0:
                continue
            (counter.labels(*labels, label_value) if LABELS.get(name) else counter.labels(*labels)).inc(value)
        for name, value in transfer_stats_data.get("gauges", {}).items():
            gauge = self._gauges.get(name)
            if gauge is not None:
                gauge.labels(*labels).set(value)

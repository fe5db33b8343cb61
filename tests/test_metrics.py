"""The engine's Prometheus metrics: families present from the start, latency histograms, one family per
concept labelled by tier, and the Grafana dashboard in docs/grafana referring only to exported families."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import generate_latest

from kvengine import KVEngine, Namespace
from kvengine.metrics import parse_samples

from .conftest import CHUNK, FakeKV, make_layout

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "kvengine.json"
TOKENS = list(range(4 * CHUNK))


def _config(tmp_path: Path, layout_bytes: int) -> dict[str, object]:
    return {"chunk_size": CHUNK, "memory": {"capacity_bytes": 8 * layout_bytes},
            "disk": {"path": str(tmp_path / "disk"), "capacity_bytes": "16MiB"}}


def _exported(eng: KVEngine) -> dict[str, float]:
    return parse_samples(generate_latest(eng.metrics.registry).decode())


def _families(samples: dict[str, float]) -> set[str]:
    return {key.split("{", 1)[0] for key in samples}


def test_every_counter_family_is_present_at_zero_from_start(tmp_path):
    """Right after start (nothing stored or looked up) every counter and histogram family has samples, all 0,
    labelled per tier (memory and local_disk) where it is per tier: a dashboard never shows "no data". The
    memory tier's capacity is exported from the start, its used bytes at 0."""
    layout = make_layout()
    with KVEngine(_config(tmp_path, layout.nbytes())) as eng:
        samples = _exported(eng)
        counters = [m for m in eng.metrics.registry.collect() if m.type in ("counter", "histogram")]
        assert len(counters) >= 20
        for family in counters:
            values = [s for s in family.samples if not s.name.endswith("_created")]
            assert values, f"{family.name} has no samples at start"
            assert all(s.value == 0 for s in values), family.name
        for family in ("kvengine_stored_bytes_total", "kvengine_loaded_bytes_total", "kvengine_evictions_total"):
            for tier in ("memory", "local_disk"):
                assert samples[f'{family}{{tier="{tier}"}}'] == 0
        assert samples['kvengine_integrity_failures_total{reason="bad_magic",tier="local_disk"}'] == 0
        assert samples['kvengine_tier_errors_total{op="get",tier="local_disk"}'] == 0
        assert samples['kvengine_tier_capacity_bytes{tier="memory"}'] == eng.core.memory.capacity_bytes > 0
        assert samples['kvengine_tier_used_bytes{tier="memory"}'] == 0
        assert samples['kvengine_tier_capacity_bytes{tier="local_disk"}'] == 16 << 20
        assert samples["kvengine_lookups_total"] == samples["kvengine_hit_tokens_total"] == 0


def test_one_family_per_concept_with_a_tier_label(tmp_path):
    """Evictions and integrity failures are one family each, labelled by tier (memory for the memory tier's
    evictions); the former kvengine_tier_evictions / kvengine_tier_integrity_failures are gone."""
    layout = make_layout()
    with KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": 2 * layout.nbytes()},
                   "disk": {"path": str(tmp_path / "disk"), "capacity_bytes": "16MiB"}}) as eng:
        binding = eng.bind(Namespace(model="evict"), layout)
        for i in range(4):  # memory holds 2 chunks: storing 4 prompts of one chunk evicts 2
            eng.store(binding, [i * 1000 + t for t in range(CHUNK)], FakeKV(CHUNK, seed=i).source)
            eng.flush()  # on disk now: unpinned, so memory may evict it
        samples = _exported(eng)
    families = _families(samples)
    assert "kvengine_tier_evictions_total" not in families
    assert "kvengine_tier_integrity_failures_total" not in families
    assert samples['kvengine_evictions_total{tier="memory"}'] == 2
    assert samples['kvengine_evictions_total{tier="local_disk"}'] == 0
    assert {tuple(sorted(re.findall(r'(\w+)="', k))) for k in samples
            if k.startswith("kvengine_integrity_failures_total")} == {("reason", "tier")}


def test_latency_histograms_observe_lookup_load_store_and_tier_traffic(tmp_path):
    """A store observes kvengine_store_seconds and, per lower tier, kvengine_tier_write_seconds; a lookup
    that promotes from disk (a fresh engine on the same directory) observes kvengine_lookup_seconds and
    kvengine_tier_read_seconds{tier="local_disk"}; a load observes kvengine_load_seconds."""
    layout = make_layout()
    with KVEngine(_config(tmp_path, layout.nbytes())) as eng:
        binding = eng.bind(Namespace(model="latency"), layout)
        eng.store(binding, TOKENS, FakeKV(len(TOKENS)).source)
        eng.flush()
        samples = _exported(eng)
    assert samples["kvengine_store_seconds_count"] == 1 and samples["kvengine_store_seconds_sum"] > 0
    assert samples['kvengine_tier_write_seconds_count{tier="local_disk"}'] == 4
    assert samples['kvengine_tier_write_seconds_bucket{le="+Inf",tier="local_disk"}'] == 4
    with KVEngine(_config(tmp_path, layout.nbytes())) as eng:  # memory empty: the lookup promotes from disk
        binding = eng.bind(Namespace(model="latency"), layout)
        res = eng.lookup(binding, "r", TOKENS)
        assert res.matched_tokens == len(TOKENS)
        assert eng.load(res, lambda view: None).loaded_tokens == len(TOKENS)
        samples = _exported(eng)
    assert samples["kvengine_lookup_seconds_count"] == 1 and samples["kvengine_lookup_seconds_sum"] > 0
    assert samples['kvengine_tier_read_seconds_count{tier="local_disk"}'] == 1
    assert samples["kvengine_load_seconds_count"] == 1
    assert samples['kvengine_loaded_bytes_total{tier="local_disk"}'] == 4 * layout.nbytes()
    assert samples["kvengine_store_seconds_count"] == 0


def _dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        exprs.append(query.get("query", "") if isinstance(query, dict) else str(query or ""))
    return exprs


def test_dashboard_refers_only_to_families_a_real_engine_exports(tmp_path):
    """Every kvengine_* name in the dashboard's PromQL (panels and template variables) is a sample name that
    an engine with a memory and a disk tier exports after one store and one lookup + load; and the dashboard
    has the panels an operator needs (hit rate, tokens saved, per-tier traffic, fill, reservations,
    evictions, integrity failures, latency quantiles)."""
    layout = make_layout()
    with KVEngine(_config(tmp_path, layout.nbytes())) as eng:
        binding = eng.bind(Namespace(model="dashboard"), layout)
        eng.store(binding, TOKENS, FakeKV(len(TOKENS)).source)
        eng.load(eng.lookup(binding, "r", TOKENS, max_tokens=len(TOKENS) - 1), lambda view: None)
        eng.flush()
        exported = _families(_exported(eng))
    exprs = _dashboard_expressions()
    referenced = {name for e in exprs for name in re.findall(r"\bkvengine_[a-z0-9_]+", e)}
    assert referenced and referenced <= exported, sorted(referenced - exported)
    text = " ".join(exprs)
    for needed in ("kvengine_hit_tokens_total", "kvengine_lookup_tokens_total", "kvengine_loaded_tokens_total",
                   "kvengine_stored_bytes_total", "kvengine_loaded_bytes_total", "kvengine_tier_used_bytes",
                   "kvengine_tier_capacity_bytes", "kvengine_reservations_active", "kvengine_evictions_total",
                   "kvengine_integrity_failures_total", "kvengine_quarantined_namespaces"):
        assert needed in text, needed
    for op in ("lookup", "load", "store", "tier_read", "tier_write"):
        assert re.search(rf"histogram_quantile\(0\.99, .*kvengine_{op}_seconds_bucket", text), op

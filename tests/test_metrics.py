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
    """Right after start and a model's bind (nothing stored or looked up) every counter and histogram family
    has samples, all 0, labelled per tier (memory and local_disk) where it is per tier: a dashboard never shows
    "no data". Before any bind, the per-model families have no series yet, but parse_samples still gives their
    totals (bare names) at 0. The memory tier's capacity is exported from the start, its used bytes at 0."""
    layout = make_layout()
    with KVEngine(_config(tmp_path, layout.nbytes())) as eng:
        unbound = _exported(eng)
        assert unbound["kvengine_lookups_total"] == unbound["kvengine_hit_tokens_total"] == 0
        assert unbound["kvengine_load_seconds_count"] == unbound["kvengine_stored_chunks_total"] == 0
        eng.bind(Namespace(model="zero"), layout)
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
        assert samples['kvengine_tier_capacity_bytes{tier="memory"}'] == eng._core.memory.capacity_bytes > 0
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
    assert {tuple(sorted(re.findall(r'(\w+)="', k))) for k in samples  # the bare name is parse_samples' sum
            if k.startswith("kvengine_integrity_failures_total{")} == {("reason", "tier")}


def test_latency_histograms_observe_lookup_load_store_and_tier_traffic(tmp_path):
    """A store observes kvengine_store_seconds and, per lower tier, kvengine_tier_write_seconds; a lookup
    that promotes from disk (a fresh engine on the same directory) observes kvengine_lookup_seconds and
    kvengine_tier_read_seconds{tier="local_disk"}; a load observes kvengine_load_seconds and counts the bytes it
    handed out from memory."""
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
        assert res.tokens == len(TOKENS)
        assert eng.load(res, lambda view: None).loaded_tokens == len(TOKENS)
        samples = _exported(eng)
    assert samples["kvengine_lookup_seconds_count"] == 1 and samples["kvengine_lookup_seconds_sum"] > 0
    assert samples['kvengine_tier_read_seconds_count{tier="local_disk"}'] == 1
    assert samples["kvengine_load_seconds_count"] == 1
    assert samples['kvengine_loaded_bytes_total{tier="local_disk"}'] == 4 * layout.nbytes()
    assert samples['kvengine_loaded_bytes_total{tier="memory"}'] == 4 * layout.nbytes()  # what the load handed out
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


def _two_models(eng: KVEngine) -> None:
    """Model a: 4 chunks stored, one lookup of 3 (capped) loaded whole. Model b: 2 chunks stored, one lookup of
    4 chunks finding 2, whose load fails on the second; and one lookup of 1 chunk (a hit) released unloaded."""
    layout = make_layout()
    a = eng.bind(Namespace(model="a"), layout)
    b = eng.bind(Namespace(model="b"), layout)
    eng.store(a, TOKENS, FakeKV(len(TOKENS)).source)
    eng.store(b, TOKENS[: 2 * CHUNK], FakeKV(2 * CHUNK, seed=1).source)
    assert eng.load(eng.lookup(a, "ra", TOKENS, max_tokens=len(TOKENS) - 1), lambda view: None).loaded_tokens \
        == 3 * CHUNK

    def fail_second(view) -> None:
        if view.index == 1:
            raise RuntimeError("sink full")

    assert eng.load(eng.lookup(b, "rb", TOKENS), fail_second).loaded_tokens == CHUNK
    eng.release(eng.lookup(b, "rb2", TOKENS[: CHUNK]))


def test_per_request_families_are_labelled_by_model_and_sum_to_the_totals(tmp_path):
    """Two models bound in one engine: lookups, asked/hit/loaded/load-failed tokens, stored chunks and bytes
    and the lookup/load/store latency histograms carry each model's own values under ``model`` (its
    Namespace.model); the per-model series sum to the totals, which EngineMetrics.value and parse_samples'
    bare names (and keys without the model label) give as before."""
    layout = make_layout()
    with KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": 16 * layout.nbytes()}}) as eng:
        _two_models(eng)
        samples = _exported(eng)
        value = eng.metrics.value
        assert value("kvengine_hit_tokens_total") == 6 * CHUNK  # the total over models, as before
        assert value("kvengine_hit_tokens_total", model="b") == 3 * CHUNK
    expected = {"kvengine_lookups_total": (1, 2),
                "kvengine_lookup_tokens_total": (len(TOKENS) - 1, len(TOKENS) + CHUNK),
                "kvengine_hit_tokens_total": (3 * CHUNK, 3 * CHUNK), "kvengine_loaded_tokens_total": (3 * CHUNK, CHUNK),
                "kvengine_load_failed_tokens_total": (0, CHUNK), "kvengine_lookup_seconds_count": (1, 2),
                "kvengine_load_seconds_count": (1, 1), "kvengine_store_seconds_count": (1, 1)}
    for name, (a, b) in expected.items():
        assert samples[f'{name}{{model="a"}}'] == a, name
        assert samples[f'{name}{{model="b"}}'] == b, name
        assert samples[name] == a + b, name
    assert samples['kvengine_stored_chunks_total{model="a",tier="memory"}'] == 4
    assert samples['kvengine_stored_chunks_total{model="b",tier="memory"}'] == 2
    assert samples['kvengine_stored_chunks_total{tier="memory"}'] == samples["kvengine_stored_chunks_total"] == 6
    assert samples['kvengine_stored_bytes_total{tier="memory"}'] == 6 * layout.nbytes()
    assert samples['kvengine_lookup_seconds_bucket{le="+Inf"}'] == 3
    assert sum(v for k, v in samples.items() if k.startswith("kvengine_lookups_total{")) == 3


def test_a_bound_models_series_exist_at_zero_before_any_lookup(tmp_path):
    """Binding a model creates its series of every per-model family at 0 (per tier for the store counters,
    the lower tiers included) before it is looked up or stored; another model's traffic leaves them at 0."""
    layout = make_layout()
    with KVEngine(_config(tmp_path, layout.nbytes())) as eng:
        busy = eng.bind(Namespace(model="busy"), layout)
        eng.bind(Namespace(model="idle"), layout)
        eng.load(eng.lookup(busy, "r", TOKENS), lambda view: None)
        samples = _exported(eng)
    for name in ("kvengine_lookups_total", "kvengine_lookup_tokens_total", "kvengine_hit_tokens_total",
                 "kvengine_loaded_tokens_total", "kvengine_load_failed_tokens_total", "kvengine_lookup_seconds_count",
                 "kvengine_load_seconds_count", "kvengine_store_seconds_count"):
        assert samples[f'{name}{{model="idle"}}'] == 0, name
    for tier in ("memory", "local_disk"):
        assert samples[f'kvengine_stored_chunks_total{{model="idle",tier="{tier}"}}'] == 0
        assert samples[f'kvengine_stored_bytes_total{{model="idle",tier="{tier}"}}'] == 0
    assert samples['kvengine_lookups_total{model="busy"}'] == 1
    assert samples['kvengine_lookup_tokens_total{model="busy"}'] == len(TOKENS)


def test_parse_samples_adds_bare_name_totals_without_replacing_exposed_samples():
    """parse_samples keeps every sample as exposed and adds, for labelled samples, the bare name mapped to the
    sum over them (not for _bucket / _created), each key with the model label dropped mapped to the sum over
    models, and 0 for a declared family with no series yet; an exposed key is never replaced."""
    text = "\n".join([
        "# TYPE kvengine_hit_tokens_total counter",
        'kvengine_hit_tokens_total{model="a"} 3.0',
        'kvengine_hit_tokens_total{model="b\\"x"} 4.0',
        'kvengine_hit_tokens_created{model="a"} 1.7e9',
        "# TYPE kvengine_stored_chunks_total counter",
        'kvengine_stored_chunks_total{model="a",tier="memory"} 2.0',
        'kvengine_stored_chunks_total{model="b",tier="memory"} 5.0',
        'kvengine_stored_chunks_total{model="a",tier="local_disk"} 1.0',
        "# TYPE kvengine_lookup_seconds histogram",
        'kvengine_lookup_seconds_bucket{le="0.1",model="a"} 1.0',
        'kvengine_lookup_seconds_bucket{le="0.1",model="b"} 2.0',
        'kvengine_lookup_seconds_count{model="a"} 1.0',
        'kvengine_lookup_seconds_count{model="b"} 2.0',
        "# TYPE kvengine_reservations_active gauge",
        "kvengine_reservations_active 9.0",
        "# TYPE kvengine_vllm_pinned_chunks gauge",
        'kvengine_vllm_pinned_chunks{worker="0"} 6.0',
        "kvengine_vllm_pinned_chunks 1.0",
        "# TYPE kvengine_lookups counter",
        "# TYPE kvengine_load_seconds histogram",
        "vllm:other 5.0",
    ])
    m = parse_samples(text)
    assert m['kvengine_hit_tokens_total{model="a"}'] == 3 and m["kvengine_hit_tokens_total"] == 7
    assert "kvengine_hit_tokens_created" not in m
    assert m["kvengine_stored_chunks_total"] == 8
    assert m['kvengine_stored_chunks_total{tier="memory"}'] == 7
    assert m['kvengine_stored_chunks_total{tier="local_disk"}'] == 1
    assert m['kvengine_lookup_seconds_bucket{le="0.1"}'] == 3 and "kvengine_lookup_seconds_bucket" not in m
    assert m["kvengine_lookup_seconds_count"] == 3
    assert m["kvengine_reservations_active"] == 9
    assert m["kvengine_vllm_pinned_chunks"] == 1  # exposed unlabelled: kept as exposed
    assert m["kvengine_lookups_total"] == 0  # declared, no series yet
    assert m["kvengine_load_seconds_count"] == m["kvengine_load_seconds_sum"] == 0
    assert not any(k.startswith("vllm") for k in m)

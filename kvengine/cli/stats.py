"""``kvengine stats``: one snapshot of a running engine, read from its Prometheus metrics endpoint.

The engine exports its metrics when started with ``metrics_port`` (see the README's
"Operating it"); this command reads that endpoint, so it works on an engine inside
any process (a vLLM worker, an SGLang server) without attaching to it. Imports
neither torch nor the engine: :mod:`kvengine.metrics` only parses the text format.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvengine.metrics import parse_key, scrape_url

#: Exit status when the endpoint cannot be read (as for a usage error: nothing was shown).
UNREACHABLE = 2

@dataclass(frozen=True)
class Snapshot:
    """What one scrape of an engine says, in the terms an operator asks about (counters are totals
    since the engine started; per-tier maps are keyed by tier name, ``memory`` first)."""

    taken_at: float  # time.monotonic() of the scrape, for rates between two snapshots
    lookups: float = 0.0
    lookup_tokens: float = 0.0  # tokens asked for by lookups
    hit_tokens: float = 0.0  # tokens lookups found cached (promised to their loads)
    loaded_tokens: float = 0.0  # tokens loads delivered: prefill the caller did not recompute
    load_failed_tokens: float = 0.0
    reservations_active: float = 0.0
    quarantined_namespaces: float = 0.0
    quarantine_refusals: float = 0.0
    stored_bytes: dict[str, float] = field(default_factory=dict)
    loaded_bytes: dict[str, float] = field(default_factory=dict)
    stored_chunks: dict[str, float] = field(default_factory=dict)
    chunks: dict[str, float] = field(default_factory=dict)  # held now
    used_bytes: dict[str, float] = field(default_factory=dict)
    capacity_bytes: dict[str, float] = field(default_factory=dict)  # tiers that report one
    evictions: dict[str, float] = field(default_factory=dict)
    integrity_failures: dict[str, float] = field(default_factory=dict)  # all reasons together
    tier_errors: dict[str, float] = field(default_factory=dict)  # all ops together
    #: Per bound model (the ``model`` label): lookups, lookup_tokens, hit_tokens, loaded_tokens,
    #: load_failed_tokens. The fields above are the totals over models.
    models: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float | None:
        """Hit tokens / asked tokens (None before any lookup)."""
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else None

    @property
    def tokens_saved(self) -> float:
        """Prefill tokens the engine saved: tokens its loads delivered."""
        return self.loaded_tokens

    def fill(self, tier: str) -> float | None:
        """Used / capacity of ``tier`` (None where it reports no capacity)."""
        capacity = self.capacity_bytes.get(tier)
        return self.used_bytes.get(tier, 0.0) / capacity if capacity else None

    @property
    def tiers(self) -> list[str]:
        """Every tier named by any sample, memory first."""
        names = {*self.stored_bytes, *self.loaded_bytes, *self.chunks, *self.used_bytes, *self.evictions,
                 *self.integrity_failures}
        return sorted(names, key=lambda t: (t != "memory", t))

    @classmethod
    def from_samples(cls, samples: Mapping[str, float], taken_at: float | None = None) -> Snapshot:
        """A snapshot of samples keyed as exposed (:func:`kvengine.metrics.parse_samples`)."""
        scalars: dict[str, float] = {}
        per_tier: dict[str, dict[str, float]] = {}
        by_tier = {"kvengine_stored_bytes_total": "stored_bytes", "kvengine_loaded_bytes_total": "loaded_bytes",
                   "kvengine_stored_chunks_total": "stored_chunks", "kvengine_tier_chunks": "chunks",
                   "kvengine_tier_used_bytes": "used_bytes", "kvengine_tier_capacity_bytes": "capacity_bytes",
                   "kvengine_evictions_total": "evictions",
                   "kvengine_integrity_failures_total": "integrity_failures",
                   "kvengine_tier_errors_total": "tier_errors"}
        plain = {"kvengine_lookups_total": "lookups", "kvengine_lookup_tokens_total": "lookup_tokens",
                 "kvengine_hit_tokens_total": "hit_tokens", "kvengine_loaded_tokens_total": "loaded_tokens",
                 "kvengine_load_failed_tokens_total": "load_failed_tokens",
                 "kvengine_reservations_active": "reservations_active",
                 "kvengine_quarantined_namespaces": "quarantined_namespaces",
                 "kvengine_quarantine_refusals_total": "quarantine_refusals"}
        models: dict[str, dict[str, float]] = {}
        for key, value in samples.items():
            name, labels = parse_key(key)
            if "model" in labels:  # a per-model series: its total has a key of its own (parse_samples)
                if name in plain:
                    per_model = models.setdefault(labels["model"], {})
                    per_model[plain[name]] = per_model.get(plain[name], 0.0) + value
                continue
            if name in plain:
                if labels and name in samples:  # the bare name already holds the sum over labels
                    continue
                scalars[plain[name]] = scalars.get(plain[name], 0.0) + value
            elif name in by_tier and "tier" in labels:
                tiers = per_tier.setdefault(by_tier[name], {})
                tiers[labels["tier"]] = tiers.get(labels["tier"], 0.0) + value
        return cls(taken_at=time.monotonic() if taken_at is None else taken_at, **scalars, **per_tier,  # type: ignore[arg-type]
                   models=dict(sorted(models.items())))

    def as_dict(self) -> dict[str, object]:
        out = dataclasses.asdict(self)
        del out["taken_at"]
        out.update(hit_rate=self.hit_rate, tokens_saved=self.tokens_saved,
                   fill={t: self.fill(t) for t in self.capacity_bytes})
        return out


def fetch(url: str, *, timeout: float = 5.0) -> Snapshot:
    """Scrape ``url`` once.

    :raises OSError: unreachable, refused, timed out or an HTTP error.
    :raises ValueError: ``url`` is not a URL urllib can open.
    """
    return Snapshot.from_samples(scrape_url(url, timeout=timeout))


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _count(n: float) -> str:
    return f"{n:,.0f}"


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def render(snap: Snapshot, previous: Snapshot | None = None, *, url: str = "") -> str:
    """The snapshot as text; with ``previous``, also the rates per second since then."""
    lines = [f"kvengine  {url}".rstrip()]
    lines.append(f"hit rate        {_percent(snap.hit_rate)}  ({_count(snap.hit_tokens)} hit tokens of "
                 f"{_count(snap.lookup_tokens)} asked, {_count(snap.lookups)} lookups)")
    lines.append(f"tokens saved    {_count(snap.tokens_saved)}  (loaded instead of recomputed; "
                 f"{_count(snap.load_failed_tokens)} promised but not delivered)")
    for model, m in snap.models.items():
        asked, hit = m.get("lookup_tokens", 0.0), m.get("hit_tokens", 0.0)
        lines.append(f"  model {model}: {_percent(hit / asked if asked else None)} hit  ({_count(hit)} of "
                     f"{_count(asked)} asked tokens, {_count(m.get('lookups', 0.0))} lookups, "
                     f"{_count(m.get('loaded_tokens', 0.0))} tokens saved)")
    if "memory" in snap.capacity_bytes:
        lines.append(f"memory fill     {_percent(snap.fill('memory'))}  ({_bytes(snap.used_bytes.get('memory', 0))} "
                     f"of {_bytes(snap.capacity_bytes['memory'])})")
    for tier in snap.tiers:
        if tier != "memory" and tier in snap.capacity_bytes:
            lines.append(f"{tier + ' fill':<15} {_percent(snap.fill(tier))}  ({_bytes(snap.used_bytes.get(tier, 0))} "
                         f"of {_bytes(snap.capacity_bytes[tier])})")
    lines.append(f"reservations    {_count(snap.reservations_active)} active")
    lines.append(f"evictions       {_count(sum(snap.evictions.values()))}")
    lines.append(f"integrity       {_count(sum(snap.integrity_failures.values()))} failures, "
                 f"{_count(snap.quarantined_namespaces)} namespaces quarantined "
                 f"({_count(snap.quarantine_refusals)} refusals)")
    # Seconds since the previous snapshot (None: no rates to show).
    dt = snap.taken_at - previous.taken_at if previous is not None and snap.taken_at > previous.taken_at else None
    if previous is not None and dt is not None:

        def rate(now: float, before: float) -> str:
            return f"{max(0.0, now - before) / dt:,.1f}"

        lines.append(f"rates/s         lookups {rate(snap.lookups, previous.lookups)}, hit tokens "
                     f"{rate(snap.hit_tokens, previous.hit_tokens)}, asked tokens "
                     f"{rate(snap.lookup_tokens, previous.lookup_tokens)}, tokens saved "
                     f"{rate(snap.tokens_saved, previous.tokens_saved)}  (over {dt:.1f} s)")
    header = f"{'tier':<12} {'chunks':>8} {'used':>11} {'stored':>11} {'loaded':>11} {'stored ch':>9} " \
             f"{'evicted':>8} {'corrupt':>8} {'errors':>7}"
    if dt is not None:
        header += f" {'store/s':>11} {'load/s':>11}"
    lines += ["", header]
    for tier in snap.tiers:
        row = (f"{tier:<12} {_count(snap.chunks.get(tier, 0)):>8} {_bytes(snap.used_bytes.get(tier, 0)):>11} "
               f"{_bytes(snap.stored_bytes.get(tier, 0)):>11} {_bytes(snap.loaded_bytes.get(tier, 0)):>11} "
               f"{_count(snap.stored_chunks.get(tier, 0)):>9} {_count(snap.evictions.get(tier, 0)):>8} "
               f"{_count(snap.integrity_failures.get(tier, 0)):>8} {_count(snap.tier_errors.get(tier, 0)):>7}")
        if previous is not None and dt is not None:
            stored = max(0.0, snap.stored_bytes.get(tier, 0) - previous.stored_bytes.get(tier, 0)) / dt
            loaded = max(0.0, snap.loaded_bytes.get(tier, 0) - previous.loaded_bytes.get(tier, 0)) / dt
            row += f" {_bytes(stored) + '/s':>11} {_bytes(loaded) + '/s':>11}"
        lines.append(row)
    return "\n".join(lines)


def add_endpoint_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--url", help="the engine's metrics endpoint, e.g. http://127.0.0.1:9400/metrics")
    where.add_argument("--port", type=int, help="the engine's metrics_port on --host (default host 127.0.0.1)")
    parser.add_argument("--host", default="127.0.0.1", help="host of --port (default 127.0.0.1)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the endpoint (default 5)")


def endpoint(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    if args.url:
        return str(args.url)
    if args.port is None:
        parser.error("one of --url or --port is required")
    return f"http://{args.host}:{args.port}/metrics"


def unreachable(command: str, url: str, exc: BaseException) -> int:
    """One line on stderr; the exit status for an endpoint that cannot be read."""
    reason = getattr(exc, "reason", None) or exc
    print(f"kvengine {command}: cannot read metrics from {url}: {reason}", file=sys.stderr)
    return UNREACHABLE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvengine stats", description="Show a running engine's cache statistics, read from its Prometheus "
        "metrics endpoint (the engine's metrics_port): hit rate, tokens saved, per-tier traffic, memory fill, "
        "reservations, evictions, integrity failures. Exit 2 when the endpoint cannot be read.")
    add_endpoint_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the snapshot as one JSON object")
    args = parser.parse_args(argv)
    url = endpoint(parser, args)
    try:
        snap = fetch(url, timeout=args.timeout)
    except (OSError, ValueError) as exc:
        return unreachable("stats", url, exc)
    print(json.dumps(snap.as_dict(), sort_keys=True) if args.json else render(snap, url=url))
    return 0


if __name__ == "__main__":
    sys.exit(main())

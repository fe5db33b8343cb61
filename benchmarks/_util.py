"""Small helpers shared by the benchmark scripts."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def median_time(fn: Callable[[], object], repeats: int, setup: Callable[[], object] | None = None) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs (``setup`` runs untimed before each)."""
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def print_table(title: str, header: list[str], rows: list[list[object]]) -> None:
    cells = [header] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for j, r in enumerate(cells):
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)))
        if j == 0:
            print("  " + "  ".join("-" * w for w in widths))


def write_json(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path

"""Before/after a refactor: the core, disk and peer benchmarks of two revisions, side by side in one run.

Usage: ``.venv/bin/python benchmarks/bench_before_after.py --before-rev 18da122 [--after-rev HEAD] [--rounds 3]
[--benches core disk peers]``

Each revision is checked out whole (``git archive``) into a scratch directory, laid out as it is imported
(``transports/`` and ``integrations/`` inside ``kvengine/``), and runs its *own* benchmark scripts there (the
measurement code of a revision matches its module paths), so each arm writes into its own results directory
and the repository's results are left alone. Per round the arms alternate order; per benchmark a few headline
figures are read from its JSON and reported as medians over rounds and as after/before ratios. The machine is
shared and noisy: read the ratios with the spread of the rounds, printed beside them.
Results: a table, and ``benchmarks/results/before_after.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from _util import print_header, print_table, snapshot, write_json

#: per benchmark: its arguments (short settings: several rounds of each arm must fit a session) and its
#: headline figures, each a path into the benchmark's JSON and whether higher is better
Figure = tuple[str, Callable[[dict[str, Any]], float], bool]
BENCHES: dict[str, tuple[list[str], list[Figure]]] = {
    "core": (["--tokens", "16384", "--repeats", "3", "--skip-per-layer"], [
        ("store us/chunk", lambda d: d["control"]["store_us_per_chunk"], False),
        ("retrieve us/chunk", lambda d: d["control"]["retrieve_us_per_chunk"], False),
        ("lookup+release ms", lambda d: d["control"]["lookup_release_ms"], False),
        ("L1 store / raw copy", lambda d: d["l1_stacked"]["store_ratio"], True),
        ("L1 retrieve / raw copy", lambda d: d["l1_stacked"]["retrieve_ratio"], True),
    ]),
    "disk": (["--total-gib", "0.25", "--repeats", "3", "--rebuild-chunks", "20000"], [
        ("persist / best raw write", lambda d: d["median_ratios"]["persist_vs_best_raw"], True),
        ("read / best raw read", lambda d: d["median_ratios"]["read_vs_best_raw"], True),
        ("index rebuild, warm s", lambda d: d["rebuild"]["warm_s"], False),
    ]),
    "peers": (["--repeats", "3", "--skip-ucx"], [
        ("kvtcp get / raw tcp", lambda d: d["ratios"]["kvtcp_vs_tcp_get"], True),
        ("kvtcp put / raw tcp", lambda d: d["ratios"]["kvtcp_vs_tcp_put"], True),
        ("zmq get GB/s", lambda d: d["medians"]["zmq"]["get_gbps"], True),
        ("kvtcp CPU ms / 32 MiB get", lambda d: d["medians"]["kvtcp"]["get_cpu_ms"], False),
    ]),
}


def run_arm(tree: Path, bench: str) -> dict[str, Any]:
    """Run ``tree``'s own ``bench_<bench>.py`` with ``tree`` first on the path; its JSON result."""
    args, _ = BENCHES[bench]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, str(tree / "benchmarks" / f"bench_{bench}.py"), *args], cwd=tree, env=env,
                   check=True, stdout=subprocess.DEVNULL)
    return json.loads((tree / "benchmarks" / "results" / f"{bench}.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before-rev", required=True)
    p.add_argument("--after-rev", default="HEAD")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--benches", nargs="+", choices=sorted(BENCHES), default=sorted(BENCHES))
    args = p.parse_args()
    print_header()
    samples: dict[str, dict[str, dict[str, list[float]]]] = {}
    with tempfile.TemporaryDirectory() as work:
        trees = {"before": snapshot(args.before_rev, Path(work) / "before"),
                 "after": snapshot(args.after_rev, Path(work) / "after")}
        for r in range(args.rounds):
            for bench in args.benches:
                for arm in ("before", "after") if r % 2 == 0 else ("after", "before"):
                    result = run_arm(trees[arm], bench)
                    for name, read, _ in BENCHES[bench][1]:
                        samples.setdefault(bench, {}).setdefault(name, {}).setdefault(arm, []).append(read(result))
                    print(f"round {r + 1}/{args.rounds}: {bench} {arm} done", flush=True)
    rows, out = [], {}
    for bench, figures in samples.items():
        for name, _read, higher_is_better in BENCHES[bench][1]:
            got = figures[name]
            before, after = statistics.median(got["before"]), statistics.median(got["after"])
            ratio = after / before if before else float("nan")
            spread = f"{min(got['after']):.3g}-{max(got['after']):.3g} vs {min(got['before']):.3g}-{max(got['before']):.3g}"
            rows.append([bench, name, f"{before:.4g}", f"{after:.4g}", f"{ratio:.2f}x",
                         "higher" if higher_is_better else "lower", spread])
            out[f"{bench}: {name}"] = {"before": got["before"], "after": got["after"], "ratio_of_medians": ratio,
                                       "higher_is_better": higher_is_better}
    print_table(f"{args.before_rev} -> {args.after_rev}, medians of {args.rounds} rounds",
                ["bench", "figure", "before", "after", "after/before", "better", "range after vs before"], rows)
    write_json("before_after.json", {"before_rev": args.before_rev, "after_rev": args.after_rev,
                                     "rounds": args.rounds, "figures": out})


if __name__ == "__main__":
    main()

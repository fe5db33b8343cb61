"""The hostile-peer report: every attack of tests/transports/peers/hostile.py (ZeroMQ) and hostile_tcp.py (tcp
wire), one table (docs/security.md).

    .venv/bin/python benchmarks/bench_hostile_peers.py

Each attack runs on real loopback sockets against a fresh ``kvengine serve`` process (RSS and counters
of that attack alone) while an honest victim reads its own chunks. Columns: attempts; detected (refused,
rejected or counted by the server or the victim); served wrong (must be 0); time to miss (per attempt
for the batch attacks, whole for floods and lookups); the server's RSS growth; whether the victim was
served exactly, with its slowest read. Results also go to results/hostile_peers.json.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _util import print_header, write_json

from tests.transports.peers import hostile, hostile_tcp


def main() -> None:
    print_header()
    with tempfile.TemporaryDirectory() as work:
        outcomes = asyncio.run(hostile.run_all(Path(work)))
        outcomes += asyncio.run(hostile_tcp.run_all(Path(work)))
    print()
    print(hostile.HEADER)
    for outcome in outcomes:
        print(outcome.row())
    path = write_json("hostile_peers.json", {"attacks": [dataclasses.asdict(o) for o in outcomes]})
    print(f"\nwrote {path}")
    if any(o.served_wrong for o in outcomes):
        sys.exit("an attack got wrong KV served")


if __name__ == "__main__":
    main()

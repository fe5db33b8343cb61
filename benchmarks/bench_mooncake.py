"""The Mooncake Store tier next to Mooncake's own fastest calls and kvengine's ZeroMQ peers, same bytes, one run.

Usage: ``.venv/bin/python benchmarks/bench_mooncake.py [--repeats 5] [--records 32] [--record-mib 4]``

Processes, all on loopback: a real ``mooncake_master``; a holder node
(127.0.0.2) that contributes the memory segment every object lands in, and
runs a kvengine ZeroMQ peer server; this process as a client node
(127.0.0.3, no segment), so every byte crosses a socket. Per repetition
(arm order alternates), ``--records`` records of ``--record-mib`` MiB:

* ``direct``: ``batch_put_from`` / ``batch_get_into`` on buffers registered
  with Mooncake, the same client the tier uses (its fastest API);
* ``tier``: :class:`MooncakeStoreTransport` ``put_parts`` (header + payload
  gathered, as the engine writes from a memory slot) and ``get`` (records
  into the tier's receive buffers);
* ``zmq``: kvengine's ZeroMQ peer transport to the holder's peer server.

Objects are removed before each put (a put to an existing key transfers
nothing). Small requests: a 4 KiB record's get, median of ``--small`` round
trips, per arm. Results: a table, ``benchmarks/results/mooncake.json`` and
``docs/benchmarks_mooncake.png`` (matplotlib, skipped if absent).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))

from _util import print_header, print_table, write_json

PNG = Path(__file__).parents[1] / "docs" / "benchmarks_mooncake.png"
HOLDER, CLIENT = "127.0.0.2", "127.0.0.3"


# -- holder node (subprocess) ------------------------------------------------------------------------
def _holder(master: str, segment_bytes: int, peer_store_bytes: int) -> None:
    """A node that contributes the segment, and serves kvengine peers over ZeroMQ."""
    os.environ["MC_TCP_BIND_ADDRESS"] = HOLDER
    from mooncake.store import MooncakeDistributedStore

    from kvengine.transports.peers.store import MemoryRecordStore
    from kvengine.transports.peers.zmq import ZmqPeerServer

    store = MooncakeDistributedStore()
    code = store.setup(HOLDER, "P2PHANDSHAKE", segment_bytes, 16 << 20, "tcp", "", master)
    if code != 0:
        raise SystemExit(f"holder setup failed: {code}")

    async def main() -> None:
        server = ZmqPeerServer(MemoryRecordStore(peer_store_bytes), f"{HOLDER}:0")
        await server.start()
        print("ready", server.address, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the client closes stdin

    asyncio.run(main())


# -- client side ---------------------------------------------------------------------------------------
def _records(count: int, nbytes: int, tag: str) -> tuple[Any, list[Any], list[tuple[bytes, memoryview]]]:
    """``count`` records of ``nbytes`` payload in one numpy buffer: the buffer, keys, (header, payload view)."""
    import numpy as np
    import torch

    from kvengine.chunks.keys import ChunkKey, Namespace
    from kvengine.chunks.layout import KVCategory, dtype_code
    from kvengine.chunks.record import TensorDescriptor, encode_header

    digest = Namespace(model=f"bench/mooncake/{tag}").digest()
    payloads = np.frombuffer(os.urandom(count * nbytes), dtype=np.uint8).copy()
    tensors = (TensorDescriptor(0, KVCategory.OPAQUE, dtype_code(torch.uint8), (nbytes,), nbytes),)
    keys, parts = [], []
    for i in range(count):
        key = ChunkKey(digest, os.urandom(16))
        payload = payloads[i * nbytes:(i + 1) * nbytes].data
        keys.append(key)
        parts.append((bytes(encode_header(key, (0, 256), tensors, codec_id=0, raw_length=nbytes, payload=payload)),
                      payload))
    return payloads, keys, parts


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


class Bench:
    def __init__(self, master: str, zmq_address: str, records: int, record_bytes: int, small: int) -> None:
        import numpy as np

        from kvengine.transports.mooncake_store import MooncakeOptions, MooncakeStoreTransport
        from kvengine.transports.peers.client import PeerClientOptions, PeerTransport
        from kvengine.transports.peers.placement import Membership
        from kvengine.transports.peers.zmq import ZmqConnector

        self.tier = MooncakeStoreTransport(MooncakeOptions(master=master, local_hostname=CLIENT, segment_bytes=0,
                                                           timeout=60.0))
        if not self.tier.wait_connected(30):
            raise SystemExit("the tier did not reach the master")
        self.client = self.tier._store()  # the same Mooncake client: direct calls and the tier share it
        self.zmq = PeerTransport(ZmqConnector(), Membership([zmq_address]),
                                 PeerClientOptions(replicas=1, request_timeout=60, read_deadline=60, write_timeout=60))
        self.count, self.nbytes, self.small = records, record_bytes, small
        self.payloads, self.keys, self.parts = _records(records, record_bytes, "big")
        self.total = sum(len(h) + p.nbytes for h, p in self.parts)
        self.records = [(k, h + bytes(p)) for k, (h, p) in zip(self.keys, self.parts)]  # joined, for peers
        # direct: the same record bytes, laid out in one registered buffer; another one to read into
        self.src = np.frombuffer(b"".join(r for _, r in self.records), dtype=np.uint8).copy()
        self.dst = np.empty_like(self.src)
        for buf in (self.src, self.dst):
            assert self.client.register_buffer(buf.ctypes.data, buf.nbytes) == 0
        self.sizes = [len(r) for _, r in self.records]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.names = [f"bench/direct/{i}" for i in range(records)]
        _, small_keys, small_parts = _records(1, 4096, "small")
        self.small_key, self.small_parts = small_keys[0], small_parts[0]
        self.small_record = self.small_parts[0] + bytes(self.small_parts[1])

    # One arm: (put GB/s, get GB/s).
    def direct(self) -> tuple[float, float]:
        self.client.batch_remove(self.names, True)
        base = self.src.ctypes.data
        t0 = time.perf_counter()
        codes = self.client.batch_put_from(self.names, [base + o for o in self.offsets], self.sizes)
        put = time.perf_counter() - t0
        assert all(c == 0 for c in codes), codes
        base = self.dst.ctypes.data
        t0 = time.perf_counter()
        got = self.client.batch_get_into(self.names, [base + o for o in self.offsets], self.sizes)
        get = time.perf_counter() - t0
        assert got == self.sizes, got
        return _gbps(self.total, put), _gbps(self.total, get)

    async def tier_arm(self) -> tuple[float, float]:
        await self.tier.delete(self.keys)
        items = [(k, (h, p)) for k, (h, p) in zip(self.keys, self.parts)]
        t0 = time.perf_counter()
        ok = await self.tier.put_parts(items)
        put = time.perf_counter() - t0
        assert all(ok)
        t0 = time.perf_counter()
        got = await self.tier.get(self.keys)
        get = time.perf_counter() - t0
        assert [len(g) if g is not None else None for g in got] == self.sizes
        del got
        return _gbps(self.total, put), _gbps(self.total, get)

    async def zmq_arm(self) -> tuple[float, float]:
        await self.zmq.delete(self.keys)
        t0 = time.perf_counter()
        ok = await self.zmq.put(self.records)
        put = time.perf_counter() - t0
        assert all(ok)
        t0 = time.perf_counter()
        got = await self.zmq.get(self.keys)
        get = time.perf_counter() - t0
        assert [len(g) if g is not None else None for g in got] == self.sizes
        del got
        return _gbps(self.total, put), _gbps(self.total, get)

    async def small_gets(self) -> dict[str, float]:
        """Median microseconds of a 4 KiB record's get, per arm."""
        import numpy as np

        name = "bench/direct/small"
        buf = np.frombuffer(self.small_record, dtype=np.uint8).copy()
        out = np.empty_like(buf)
        for b in (buf, out):
            self.client.register_buffer(b.ctypes.data, b.nbytes)
        self.client.batch_remove([name], True)
        assert self.client.put_from(name, buf.ctypes.data, buf.nbytes) == 0
        assert all(await self.tier.put_parts([(self.small_key, self.small_parts)]))
        assert all(await self.zmq.put([(self.small_key, self.small_record)]))
        times: dict[str, list[float]] = {"direct": [], "tier": [], "zmq": []}
        for _ in range(self.small):
            t0 = time.perf_counter()
            assert self.client.get_into(name, out.ctypes.data, out.nbytes) == out.nbytes
            times["direct"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            (got,) = await self.tier.get([self.small_key])
            times["tier"].append(time.perf_counter() - t0)
            assert got is not None
            t0 = time.perf_counter()
            (got,) = await self.zmq.get([self.small_key])
            times["zmq"].append(time.perf_counter() - t0)
            assert got is not None
        return {arm: statistics.median(t) * 1e6 for arm, t in times.items()}

    async def close(self) -> None:
        await self.zmq.close()
        await self.tier.close()


def write_png(table: dict[str, dict[str, float]], small: dict[str, float], cpu: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no plot"
    arms = list(table)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.38
    xs = range(len(arms))
    left.bar([x - width / 2 for x in xs], [table[a]["put_gbps"] for a in arms], width, label="put")
    left.bar([x + width / 2 for x in xs], [table[a]["get_gbps"] for a in arms], width, label="get")
    left.set_xticks(list(xs), arms)
    left.set_ylabel("GB/s (median)")
    left.set_title("Throughput, same records")
    left.legend()
    right.bar(list(small), list(small.values()), color="tab:gray")
    right.set_ylabel("µs (median)")
    right.set_title("4 KiB record get")
    fig.suptitle(f"Mooncake Store tier on loopback TCP · {cpu}", fontsize=9)
    fig.tight_layout()
    fig.savefig(PNG, dpi=110)
    return str(PNG)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--records", type=int, default=32)
    parser.add_argument("--record-mib", type=int, default=4)
    parser.add_argument("--small", type=int, default=200)
    parser.add_argument("--role", nargs="*")
    args = parser.parse_args(argv)
    if args.role:
        _holder(*args.role[:1], *map(int, args.role[1:]))
        return 0
    os.environ["GLOG_minloglevel"] = "2"
    print_header()
    record_bytes = args.record_mib << 20
    data_bytes = args.records * (record_bytes + 8192)
    from tests.mooncake_master import Master

    master = Master()
    master.start()
    address = master.address
    holder = subprocess.Popen([sys.executable, __file__, "--role", address, str(3 * data_bytes + (64 << 20)),
                               str(2 * data_bytes + (16 << 20))], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline().split()
        if not line or line[0] != "ready":
            raise SystemExit("the holder node did not start")
        bench = Bench(address, line[1], args.records, record_bytes, args.small)
        loop = asyncio.new_event_loop()
        runs: dict[str, list[tuple[float, float]]] = {"direct": [], "tier": [], "zmq": []}
        arms = {"direct": lambda: loop.run_until_complete(asyncio.to_thread(bench.direct)),
                "tier": lambda: loop.run_until_complete(bench.tier_arm()),
                "zmq": lambda: loop.run_until_complete(bench.zmq_arm())}
        for rep in range(args.repeats + 1):  # the first repetition warms up, unrecorded
            order = list(arms) if rep % 2 == 0 else list(reversed(arms))
            for arm in order:
                result = arms[arm]()
                if rep:
                    runs[arm].append(result)
        small = loop.run_until_complete(bench.small_gets())
        loop.run_until_complete(bench.close())
    finally:
        if holder.stdin is not None:
            holder.stdin.close()
        holder.kill()
        master.kill()
    table = {arm: {"put_gbps": statistics.median(p for p, _ in r), "get_gbps": statistics.median(g for _, g in r)}
             for arm, r in runs.items()}
    rows = [[arm, t["put_gbps"], t["get_gbps"], t["put_gbps"] / table["direct"]["put_gbps"],
             t["get_gbps"] / table["direct"]["get_gbps"], small[arm]] for arm, t in table.items()]
    print_table(f"{args.records} records of {args.record_mib} MiB, median of {args.repeats}",
                ["arm", "put GB/s", "get GB/s", "put / direct", "get / direct", "4 KiB get µs"], rows)
    from _util import machine_info

    print(write_png(table, small, machine_info().cpu))
    path = write_json("mooncake.json", {"records": args.records, "record_mib": args.record_mib,
                                        "repeats": args.repeats, "throughput": table, "small_get_us": small,
                                        "runs": runs})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Peer transports on loopback next to the wire they run on, measured in the same run.

Usage: ``.venv/bin/python benchmarks/bench_peers.py [--repeats 3] [--transfers 6] [--skip-ucx]``

Server and client of each transport are separate processes on loopback
(peer clients stay up across repetitions: UCX reads ``UCX_TLS`` once per
process). Per repetition (order alternates):

* throughput: ``--transfers`` sequential 32 MiB records fetched (server ->
  client; a peer transport's into a buffer of its own), GB/s per transfer,
  median; ``put`` (client -> server, acked) likewise.
* latency: round trips of a 4 KiB message (a 4 KiB record ``get`` for the
  peer transports), median, in microseconds.

CPU: client plus server process CPU time per 32 MiB get, which, unlike
GB/s, hardly depends on what else runs on the machine (on 2 shared cores,
throughput follows CPU cost once the cores are busy).

Also kvengine's own tcp wire (``kvtcp``; ``kvtls``: the same over mutual TLS,
certificates from a throwaway CA made with ``openssl``).

Baselines: a raw TCP socket (``TCP_NODELAY``, ``recv_into`` a reused
buffer: its best case) next to ZeroMQ; ``ucx_perftest`` (tag bandwidth and
latency, same ``UCX_TLS``, from the libucx wheel) next to UCX for each of
``UCX_TLS=tcp`` and ``UCX_TLS=sm``. Peer transports go through the whole
stack: :class:`PeerTransport` -> wire -> :class:`PeerService` ->
:class:`MemoryRecordStore`, record headers checked, ~1 MiB frames for ZeroMQ.
Results: a table, and ``benchmarks/results/peers.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _util import print_header, print_table, write_json

RECORD_BYTES = 32 << 20
SMALL_BYTES = 4096
_REQ = struct.Struct("<BQ")  # raw TCP: op (0 = send me N bytes, 1 = take N bytes, ack), N


# -- server side (subprocess) ---------------------------------------------------------------------
def _tcp_server(port: int) -> None:
    srv = socket.create_server(("127.0.0.1", port))
    print("ready", flush=True)
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out = memoryview(os.urandom(RECORD_BYTES))
    sink = bytearray(RECORD_BYTES)
    head = bytearray(_REQ.size)
    while True:
        if conn.recv_into(head, _REQ.size, socket.MSG_WAITALL) < _REQ.size:
            return
        op, n = _REQ.unpack(head)
        if op == 0:
            conn.sendall(out[:n])
        else:
            _recv_exact(conn, memoryview(sink)[:n])
            conn.sendall(b"\1")


def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    while view:
        got = conn.recv_into(view)
        if not got:
            raise ConnectionError("peer closed")
        view = view[got:]


def _peer_server(kind: str, bind: str) -> None:
    from kvengine.transports.peers.store import MemoryRecordStore

    async def main() -> None:
        store = MemoryRecordStore(4 * RECORD_BYTES)
        server: Any
        if kind == "zmq":
            from kvengine.transports.peers.zmq import ZmqPeerServer

            server = ZmqPeerServer(store, bind)
        elif kind in ("kvtcp", "kvtls"):
            from kvengine.transports.peers.tcp import TcpPeerServer, TcpServerOptions

            server = TcpPeerServer(store, bind, None, TcpServerOptions(tls=_tls("server", kind)))
        else:
            from kvengine.transports.peers.ucx import UcxPeerServer

            server = UcxPeerServer(store, bind)
        await server.start()
        print("ready", server.address, flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


# -- client side -------------------------------------------------------------------------------------
def _spawn(args: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, __file__, "--role", *args], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    if not line or line[0] != "ready":
        proc.kill()
        raise RuntimeError(f"server {args} did not start")
    return proc, line[1] if len(line) > 1 else ""


def bench_tcp(transfers: int, rounds: int) -> dict[str, float]:
    port = _free_port()
    proc, _ = _spawn(["tcp-server", str(port)])
    try:
        conn = socket.create_connection(("127.0.0.1", port))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = memoryview(bytearray(RECORD_BYTES))
        ack = bytearray(1)
        get, put, lat = [], [], []
        payload = memoryview(os.urandom(RECORD_BYTES))
        cpu = _CpuMeter(proc.pid)
        for _ in range(transfers):
            t0 = time.perf_counter()
            conn.sendall(_REQ.pack(0, RECORD_BYTES))
            _recv_exact(conn, buf)
            get.append(RECORD_BYTES / (time.perf_counter() - t0) / 1e9)
        get_cpu = cpu.ms() / transfers
        for _ in range(transfers):
            t0 = time.perf_counter()
            conn.sendall(_REQ.pack(1, RECORD_BYTES))
            conn.sendall(payload)
            _recv_exact(conn, memoryview(ack))
            put.append(RECORD_BYTES / (time.perf_counter() - t0) / 1e9)
        for _ in range(rounds):
            t0 = time.perf_counter()
            conn.sendall(_REQ.pack(0, SMALL_BYTES))
            _recv_exact(conn, buf[:SMALL_BYTES])
            lat.append((time.perf_counter() - t0) * 1e6)
        conn.close()
        return {"get_gbps": statistics.median(get), "put_gbps": statistics.median(put),
                "rtt_4k_us": statistics.median(lat), "get_cpu_ms": get_cpu}
    finally:
        proc.kill()
        proc.wait()


class PeerClient:
    """A client process (with its server) kept alive across repetitions; UCX reads UCX_TLS once per process."""

    def __init__(self, kind: str, transfers: int, rounds: int, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--role", "peer-client", kind, str(transfers),
                                      str(rounds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})

    def measure(self) -> dict[str, float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer client exited with {self.proc.wait()}")
        return json.loads(line)

    def close(self) -> None:
        """End the client (closing stdin lets it stop its server first)."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _peer_client(kind: str, transfers: int, rounds: int) -> None:
    """Client role: one measurement per "run" line on stdin, printed as JSON."""
    from kvengine.transports.peers.client import PeerClientOptions, PeerTransport
    from kvengine.transports.peers.placement import Membership

    proc, address = _spawn([f"{kind}-server", "127.0.0.1:0"])
    try:
        connector: Any
        if kind == "zmq":
            from kvengine.transports.peers.zmq import ZmqConnector

            connector = ZmqConnector()
        elif kind in ("kvtcp", "kvtls"):
            from kvengine.transports.peers.tcp import TcpConnector, TcpOptions

            connector = TcpConnector(options=TcpOptions(tls=_tls("client", kind)))
        else:
            from kvengine.transports.peers.ucx import UcxConnector

            connector = UcxConnector()
        options = PeerClientOptions(replicas=1, request_timeout=30, read_deadline=30, write_timeout=30)
        transport = PeerTransport(connector, Membership([address]), options)
        big, small = _record(RECORD_BYTES), _record(SMALL_BYTES)

        async def run() -> dict[str, float]:
            assert all(await transport.put([big, small])), "warm-up put failed"
            get, put, lat = [], [], []
            cpu = _CpuMeter(proc.pid)
            for _ in range(transfers):
                t0 = time.perf_counter()
                (got,) = await transport.get([big[0]])
                get.append(len(got) / (time.perf_counter() - t0) / 1e9)
                assert got is not None and len(got) == len(big[1])
            get_cpu = cpu.ms() / transfers
            for _ in range(transfers):
                await transport.delete([big[0]])
                t0 = time.perf_counter()
                assert (await transport.put([big]))[0]
                put.append(len(big[1]) / (time.perf_counter() - t0) / 1e9)
            for _ in range(rounds):
                t0 = time.perf_counter()
                (got,) = await transport.get([small[0]])
                lat.append((time.perf_counter() - t0) * 1e6)
                assert got is not None
            return {"get_gbps": statistics.median(get), "put_gbps": statistics.median(put),
                    "rtt_4k_us": statistics.median(lat), "get_cpu_ms": get_cpu}

        loop = asyncio.new_event_loop()
        for _ in sys.stdin:
            print(json.dumps(loop.run_until_complete(run())), flush=True)
        loop.run_until_complete(transport.close())
    finally:
        proc.kill()
        proc.wait()


def _tls(name: str, kind: str) -> Any:
    """The TLS settings of ``name`` (server/client) from the run's CA (``kvtls`` only)."""
    if kind != "kvtls":
        return None
    from kvengine.transports.peers.tcp import TlsConfig

    pki = Path(os.environ["KVENGINE_BENCH_PKI"])
    return TlsConfig(cert=pki / f"{name}.pem", key=pki / f"{name}.key", ca=pki / "ca.pem")


def _record(n: int) -> tuple[object, bytes]:
    import torch

    from kvengine.chunks.keys import ChunkKey, Namespace
    from kvengine.chunks.layout import KVCategory, dtype_code
    from kvengine.chunks.record import TensorDescriptor, encode_header

    key = ChunkKey(Namespace(model="bench/peers").digest(), os.urandom(16))
    payload = os.urandom(n)
    tensors = (TensorDescriptor(0, KVCategory.OPAQUE, dtype_code(torch.uint8), (n,), n),)
    return key, encode_header(key, (0, 256), tensors, codec_id=0, raw_length=n, payload=payload) + payload


class _CpuMeter:
    """CPU seconds used by this process and the server process since creation, in ms (load-independent)."""

    def __init__(self, server_pid: int) -> None:
        self.pid = server_pid
        self.start = self._now()

    def _now(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        t = os.times()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") + t.user + t.system

    def ms(self) -> float:
        return 1e3 * (self._now() - self.start)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ucx_perftest(tls: str) -> dict[str, float] | None:
    """``ucx_perftest`` tag bandwidth (32 MiB) and latency (4 KiB) with ``UCX_TLS=tls``, or None."""
    exe = _ucx_perftest_path()
    if exe is None:
        return None
    libdir = str(Path(exe).parents[1] / "lib")  # the wheel's binary does not find its own libraries
    env = {**os.environ, "UCX_TLS": tls, "UCX_WARN_UNUSED_ENV_VARS": "n",
           "LD_LIBRARY_PATH": os.pathsep.join(p for p in (libdir, os.environ.get("LD_LIBRARY_PATH")) if p)}
    out: dict[str, float] = {}
    tests = (("tag_bw", RECORD_BYTES, 20, "get_gbps"), ("tag_lat", SMALL_BYTES, 2000, "rtt_4k_us"))
    for test, size, iters, key in tests:
        port = str(_free_port())
        server = subprocess.Popen([exe, "-p", port], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)
        try:
            res = subprocess.run([exe, "127.0.0.1", "-p", port, "-t", test, "-s", str(size), "-n", str(iters)],
                                 env=env, capture_output=True, text=True, timeout=60)
        finally:
            server.kill()
            server.wait()
        rows = [line.split() for line in res.stdout.splitlines() if line.strip().startswith("Final:")]
        if res.returncode != 0 or not rows:
            print(f"ucx_perftest {test} UCX_TLS={tls} failed: {res.stderr.strip()[-300:]}", file=sys.stderr)
            return None
        # Final: iters, latency (50th percentile, average, overall; us), bandwidth (average, overall; MiB/s), ...
        cols = rows[-1]
        if key == "get_gbps":
            out[key] = float(cols[5]) * 2**20 / 1e9
        else:
            out[key] = 2 * float(cols[2])  # perftest reports one-way latency; a round trip is two
    return out


def _ucx_perftest_path() -> str | None:
    try:
        import libucx  # type: ignore[import-not-found]
    except ImportError:
        return None
    for path in Path(libucx.__file__).parent.rglob("ucx_perftest"):
        return str(path)
    return None


def _has_ucxx() -> bool:
    try:
        import ucxx  # noqa: F401
    except Exception:
        return False
    return True


def _make_pki(root: Path) -> None:
    """A CA and a server and a client certificate it signed, in ``root`` (for ``kvtls``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.transports.peers.certs import Pki

    pki = Pki.create(root)
    for name in ("server", "client"):
        pki.issue(name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--transfers", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--skip-ucx", action="store_true")
    args = ap.parse_args(argv)
    if args.role:
        role, *rest = args.role
        if role == "tcp-server":
            _tcp_server(int(rest[0]))
        elif role == "peer-client":
            _peer_client(rest[0], int(rest[1]), int(rest[2]))
        else:
            _peer_server(role.removesuffix("-server"), rest[0])
        return 0

    print_header()
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    pki = tempfile.TemporaryDirectory()
    _make_pki(Path(pki.name))
    os.environ["KVENGINE_BENCH_PKI"] = pki.name
    clients = {kind: PeerClient(kind, args.transfers, args.rounds) for kind in ("zmq", "kvtcp", "kvtls")}
    cases: list[tuple[str, Callable[[], dict[str, float] | None]]] = [
        ("tcp", lambda: bench_tcp(args.transfers, args.rounds)),
        *((kind, client.measure) for kind, client in clients.items())]
    ucx_ok = not args.skip_ucx and _has_ucxx()
    if ucx_ok:
        for tls in ("tcp", "sm"):
            clients[f"ucx/{tls}"] = PeerClient("ucx", args.transfers, args.rounds, {"UCX_TLS": tls})
            cases.append((f"ucx_perftest/{tls}", lambda tls=tls: ucx_perftest(tls)))
            cases.append((f"ucx/{tls}", clients[f"ucx/{tls}"].measure))
    samples: dict[str, list[dict[str, float]]] = {name: [] for name, _ in cases}
    try:
        for rep in range(args.repeats):
            order = cases if rep % 2 == 0 else cases[::-1]
            for name, fn in order:
                result = fn()
                if result is not None:
                    samples[name].append(result)
    finally:
        for c in clients.values():
            c.close()
        pki.cleanup()
    med = {name: {k: statistics.median(s[k] for s in runs) for k in runs[0]} for name, runs in samples.items() if runs}

    def ratio(a: str, b: str, k: str) -> float | None:
        return med[a][k] / med[b][k] if a in med and b in med and k in med[a] and k in med[b] else None

    ratios = {
        "zmq_vs_tcp_get": ratio("zmq", "tcp", "get_gbps"),
        "zmq_cpu_per_get_vs_tcp": ratio("zmq", "tcp", "get_cpu_ms"),
        "zmq_vs_tcp_put": ratio("zmq", "tcp", "put_gbps"),
        "kvtcp_vs_tcp_get": ratio("kvtcp", "tcp", "get_gbps"),
        "kvtcp_vs_tcp_put": ratio("kvtcp", "tcp", "put_gbps"),
        "kvtcp_vs_zmq_get": ratio("kvtcp", "zmq", "get_gbps"),
        "kvtls_vs_kvtcp_get": ratio("kvtls", "kvtcp", "get_gbps"),
        "ucx_sm_vs_perftest": ratio("ucx/sm", "ucx_perftest/sm", "get_gbps"),
        "ucx_tcp_vs_perftest": ratio("ucx/tcp", "ucx_perftest/tcp", "get_gbps"),
    }
    nan = float("nan")
    rows = [[name, m.get("get_gbps", nan), m.get("put_gbps", nan), m["rtt_4k_us"], m.get("get_cpu_ms", nan)]
            for name, m in med.items()]
    print_table(f"Loopback, medians of {args.repeats} runs (32 MiB records; 4 KiB round trip; load "
                f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)",
                ["transport", "get GB/s", "put GB/s", "4 KiB RTT us", "CPU ms/get (both sides)"], rows)
    print_table("Ratios (targets: zmq/tcp >= 0.8, ucx sm / ucx_perftest sm >= 0.5)", ["ratio", "value"],
                [[k, v if v is not None else "n/a"] for k, v in ratios.items()])
    path = write_json("peers.json", {
        "machine": {"loadavg_1min_at_end": os.getloadavg()[0]},
        "config": {"record_bytes": RECORD_BYTES, "small_bytes": SMALL_BYTES, "repeats": args.repeats,
                   "transfers": args.transfers, "rounds": args.rounds, "ucx": ucx_ok},
        "samples": samples, "medians": med, "ratios": ratios,
    })
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

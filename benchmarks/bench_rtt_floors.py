"""Where a small peer request's time goes: round trips of a 4 KiB message on loopback, from the floor up.

Each row adds one layer the peer tier needs, measured side by side in one run (medians of
``--rounds`` round trips, each arm interleaved with the others in ``--repeats`` passes):

* ``thread hop``: two threads handing a message back and forth (``threading`` condition): what
  every hand-off between an event loop and another thread costs on this machine;
* ``raw TCP``: blocking sockets, one process each side (the kernel's floor);
* ``asyncio TCP``: the same through an asyncio ``Protocol`` on both sides (the event loop's floor:
  every wire kvengine runs on asyncio pays it);
* ``libzmq, blocking``: DEALER/ROUTER without asyncio (libzmq hands each message to and from its
  own I/O thread on both sides);
* ``zmq.asyncio``: the same through pyzmq's asyncio sockets;
* ``kvengine tcp-wire request``: one GET over kvengine's tcp wire without the peer tier's client
  (framing, the connection pool and the server's service: what the wire itself costs);
* ``kvengine ZeroMQ get`` / ``kvengine tcp-wire get``: a 4 KiB record through the peer tier.

Beside each round trip, the CPU time each side spent on it (the client's process time, the server
process's from ``/proc``): a round trip is about the client's CPU, the server's, and the kernel's
wake-ups between them, so the columns name where the microseconds go.

Usage: ``python benchmarks/bench_rtt_floors.py`` (writes ``benchmarks/results/rtt_floors.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _util import print_header, print_table, write_json

SMALL = 4096


# -- servers, each in its own process (``--serve KIND``) ---------------------------------------------
def serve(kind: str) -> None:
    if kind == "tcp":
        srv = socket.create_server(("127.0.0.1", 0))
        print(srv.getsockname()[1], flush=True)
        buf = bytearray(SMALL)
        while True:  # one client at a time
            conn, _ = srv.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while got := conn.recv_into(buf):
                conn.sendall(buf[:got])
            conn.close()
    if kind == "asyncio":
        class Echo(asyncio.Protocol):
            def connection_made(self, transport: Any) -> None:
                self.transport = transport

            def data_received(self, data: bytes) -> None:
                self.transport.write(data)

        async def main() -> None:
            server = await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", 0)
            print(server.sockets[0].getsockname()[1], flush=True)
            await server.serve_forever()
        asyncio.run(main())
    if kind == "zmq":
        import zmq

        sock = zmq.Context().socket(zmq.ROUTER)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        print(port, flush=True)
        while True:
            sock.send_multipart(sock.recv_multipart())


def spawn(kind: str) -> tuple[subprocess.Popen[str], int]:
    """A floor's echo server (``tcp``, ``asyncio``, ``zmq``), or kvengine's peer server over ZeroMQ
    (``kv-zmq``) or the tcp wire (``kv-tcp``), as the peer benchmark starts it; and its port."""
    if kind.startswith("kv-"):
        from bench_peers import _spawn

        proc, address = _spawn([{"kv-zmq": "zmq", "kv-tcp": "kvtcp"}[kind] + "-server", "127.0.0.1:0"])
        return proc, int(address.rsplit(":", 1)[1])
    proc = subprocess.Popen([sys.executable, __file__, "--serve", kind], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


# -- clients: each returns the median round trip in microseconds -------------------------------------
def rtt_thread_hop(rounds: int) -> float:
    cond = threading.Condition()
    box: list[int] = [0]

    def echo() -> None:
        with cond:
            for _ in range(rounds):
                cond.wait_for(lambda: box[0] == 1)
                box[0] = 2
                cond.notify()
    t = threading.Thread(target=echo)
    t.start()
    times = []
    with cond:
        for _ in range(rounds):
            t0 = time.perf_counter()
            box[0] = 1
            cond.notify()
            cond.wait_for(lambda: box[0] == 2)
            times.append(time.perf_counter() - t0)
    t.join()
    return statistics.median(times) * 1e6 / 2  # a round trip is two hops


def rtt_tcp(port: int, rounds: int) -> float:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        msg, buf, times = b"x" * SMALL, bytearray(SMALL), []
        for _ in range(rounds):
            t0 = time.perf_counter()
            s.sendall(msg)
            got = 0
            while got < SMALL:
                got += s.recv_into(memoryview(buf)[got:])
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def rtt_asyncio(port: int, rounds: int) -> float:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        waiter: list[asyncio.Future[None]] = []
        got = [0]

        class Client(asyncio.Protocol):
            def data_received(self, data: bytes) -> None:
                got[0] += len(data)
                if got[0] >= SMALL and waiter and not waiter[0].done():
                    waiter[0].set_result(None)
        transport, _ = await loop.create_connection(Client, "127.0.0.1", port)
        times, msg = [], b"x" * SMALL
        for _ in range(rounds):
            got[0] = 0
            waiter[:] = [loop.create_future()]
            t0 = time.perf_counter()
            transport.write(msg)
            await waiter[0]
            times.append(time.perf_counter() - t0)
        transport.close()
        return statistics.median(times) * 1e6
    return asyncio.run(main())


def rtt_zmq(port: int, rounds: int, use_asyncio: bool) -> float:
    import zmq
    import zmq.asyncio

    msg = b"x" * SMALL
    if not use_asyncio:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{port}")
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            sock.send(msg)
            sock.recv()
            times.append(time.perf_counter() - t0)
        sock.close(linger=0)
        return statistics.median(times) * 1e6

    async def main() -> float:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{port}")
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            await sock.send(msg)
            await sock.recv()
            times.append(time.perf_counter() - t0)
        sock.close(linger=0)
        ctx.term()
        return statistics.median(times) * 1e6
    return asyncio.run(main())


def rtt_kvengine_request(port: int, rounds: int) -> float:
    """One GET through the tcp wire's connector alone (no peer tier client: routing, record checks)."""
    from kvengine.transports.peers.client import PeerClientOptions, PeerTransport
    from kvengine.transports.peers.placement import Membership, Peer
    from kvengine.transports.peers.protocol import Op
    from kvengine.transports.peers.tcp import TcpConnector

    key, record = _record()

    async def main() -> float:
        connector = TcpConnector()
        transport = PeerTransport(TcpConnector(), Membership([f"127.0.0.1:{port}"]), PeerClientOptions(replicas=1))
        assert (await transport.put([(key, record)]))[0]
        await transport.close()
        peer, times = Peer("127.0.0.1", port), []
        for _ in range(rounds):
            t0 = time.perf_counter()
            reply = await connector.request(peer, Op.GET, [key], (), 10)
            times.append(time.perf_counter() - t0)
            assert reply is not None and reply[0].flags == (True,)
        await connector.close()
        return statistics.median(times) * 1e6
    return asyncio.run(main())


def rtt_kvengine(kind: str, port: int, rounds: int) -> float:
    from kvengine.transports.peers.client import PeerClientOptions, PeerTransport
    from kvengine.transports.peers.placement import Membership

    if kind == "kv-zmq":
        from kvengine.transports.peers.zmq import ZmqConnector
        connector: Any = ZmqConnector()
    else:
        from kvengine.transports.peers.tcp import TcpConnector
        connector = TcpConnector()
    key, record = _record()

    async def main() -> float:
        transport = PeerTransport(connector, Membership([f"127.0.0.1:{port}"]),
                                  PeerClientOptions(replicas=1, request_timeout=10, read_deadline=10, write_timeout=10))
        assert (await transport.put([(key, record)]))[0]
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            (got,) = await transport.get([key])
            times.append(time.perf_counter() - t0)
            assert got is not None
        await transport.close()
        return statistics.median(times) * 1e6
    return asyncio.run(main())


def _record() -> tuple[Any, bytes]:
    from bench_peers import _record as make  # the peer benchmark's 4 KiB record, as it measures it

    return make(SMALL)


def _process_cpu(pid: int) -> float:
    """CPU seconds (user and system) process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve)
        return 0
    print_header()
    servers = {k: spawn(k) for k in ("tcp", "asyncio", "zmq", "kv-zmq", "kv-tcp")}
    kv_rounds = args.rounds
    # name -> (the server it talks to, round trips, the measurement)
    arms: dict[str, tuple[str | None, int, Any]] = {
        "thread hop (one way)": (None, args.rounds, lambda: rtt_thread_hop(args.rounds)),
        "raw TCP, blocking": ("tcp", args.rounds, lambda: rtt_tcp(servers["tcp"][1], args.rounds)),
        "asyncio TCP (Protocol both sides)": ("asyncio", args.rounds,
                                              lambda: rtt_asyncio(servers["asyncio"][1], args.rounds)),
        "libzmq DEALER/ROUTER, blocking": ("zmq", args.rounds, lambda: rtt_zmq(servers["zmq"][1], args.rounds, False)),
        "zmq.asyncio DEALER, blocking ROUTER": ("zmq", args.rounds,
                                                lambda: rtt_zmq(servers["zmq"][1], args.rounds, True)),
        "kvengine tcp-wire request (no peer tier)": ("kv-tcp", kv_rounds,
                                                     lambda: rtt_kvengine_request(servers["kv-tcp"][1], kv_rounds)),
        "kvengine ZeroMQ get (4 KiB record)": ("kv-zmq", kv_rounds,
                                               lambda: rtt_kvengine("kv-zmq", servers["kv-zmq"][1], kv_rounds)),
        "kvengine tcp-wire get (4 KiB record)": ("kv-tcp", kv_rounds,
                                                 lambda: rtt_kvengine("kv-tcp", servers["kv-tcp"][1], kv_rounds)),
    }
    samples: dict[str, list[float]] = {k: [] for k in arms}
    client_cpu: dict[str, list[float]] = {k: [] for k in arms}
    server_cpu: dict[str, list[float]] = {k: [] for k in arms}
    try:
        for _ in range(args.repeats):
            for name, (server, rounds, fn) in arms.items():
                pid = servers[server][0].pid if server else None
                before, server_before = time.process_time(), _process_cpu(pid) if pid else 0.0
                samples[name].append(fn())
                client_cpu[name].append((time.process_time() - before) / rounds * 1e6)
                server_cpu[name].append((_process_cpu(pid) - server_before) / rounds * 1e6 if pid else 0.0)
    finally:
        for proc, _ in servers.values():
            proc.kill()
            proc.wait()
    med = {k: statistics.median(v) for k, v in samples.items()}
    cpu = {k: (statistics.median(client_cpu[k]), statistics.median(server_cpu[k])) for k in arms}
    base = med["raw TCP, blocking"]
    rows = [[k, f"{v:.1f}", f"{v / base:.1f}x" if not k.startswith("thread") else "-",
             f"{cpu[k][0]:.0f}" if arms[k][0] else "-", f"{cpu[k][1]:.0f}" if arms[k][0] else "-"]
            for k, v in med.items()]
    print_table(f"4 KiB round trips on loopback, us (medians of {args.rounds} round trips x {args.repeats} passes; "
                f"kvengine's: {kv_rounds})", ["what", "us", "over raw TCP", "client CPU us", "server CPU us"], rows)
    out = write_json("rtt_floors.json", {"rounds": args.rounds, "us": med, "samples_us": samples,
                                         "cpu_us_per_round_trip": {k: {"client": c, "server": s}
                                                                   for k, (c, s) in cpu.items()}})
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Prefill/decode disaggregation through kvengine: what the handoff costs the decode instance.

A prefill instance (``kv_role: kv_producer``) and a decode instance
(``kv_consumer``), both vLLM CPU engines in their default topology, alive at
once in this run on the same machine. Model: the random ~80M-parameter Llama
of ``bench_vllm.py`` (12 layers, 4 KV heads of 64), fp32: 24 KiB of KV per
token. Per prompt length (distinct prompts, ``--repeats`` each):

* ``prefill``  -- the producer's TTFT (``max_tokens=1``): the prompt computed
  and handed off;
* ``handoff``  -- the consumer's TTFT for that prompt with the producer's
  ``kv_transfer_params``: every token but the last loaded from the producer's
  memory over the peer wire (``--wires``: tcp, zmq, ucx; loopback), the last
  computed;
* ``transfer`` -- of that, the consumer's promotions from the producer
  (``kvengine_tier_read_seconds{tier="peers_<wire>"}``: reads, verification
  and copy into its memory tier);
* ``local``    -- the consumer's TTFT computing a prompt of that length itself
  (what a colocated instance pays);
* ``raw wire`` -- the same bytes over a plain loopback TCP socket in this run
  (``sendall``/``recv_into``), the floor any transfer over it pays.

Then the decode instance's inter-token latency: a 96-token reply of a handed-off 1,024-token prompt, with
nothing else running, with two long prompts (the largest size) started at its 4th token on the decoding
instance itself (colocated serving), and with the same prompts run by the producer at the same time
(disaggregated); p50, p95 and the worst gap between its tokens.

Figures are medians; ``transfer / handoff`` is the share of the decode
instance's TTFT the handoff costs, and ``raw / transfer`` what the peer wire
achieves of the raw socket. Both instances share this machine's cores, so the
prefill never overlaps the decode here; the multi-node expectation is a
calculation from these per-byte costs (``docs/benchmarks.md``).

    .venv-vllm/bin/python benchmarks/bench_disagg.py [--sizes 1024 4096] [--repeats 3] [--wires tcp zmq ucx]

Results: ``benchmarks/results/disagg.json``.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import machine_info, print_header, print_table, write_json

from kvengine.metrics import scrape

MODEL = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=4, head_dim=64)
KV_BYTES_PER_TOKEN = 12 * 2 * 4 * 64 * 4  # layers x (K, V) x KV heads x head dim x fp32
CONNECTOR = "kvengine.integrations.vllm.connector"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 4096) for _ in range(n)]


def _engine(model: str, role: str, extra: dict[str, Any], max_len: int) -> Any:
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(EngineArgs(
        model=model, dtype="float32", max_model_len=max_len, enforce_eager=True, max_num_seqs=4,
        enable_prefix_caching=False, seed=0, kv_transfer_config={
            "kv_connector": "KVEngineConnector", "kv_connector_module_path": CONNECTOR, "kv_role": role,
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}))


def _ttft(engine: Any, tokens: list[int], params: dict[str, Any] | None = None) -> tuple[float, Any]:
    """Seconds to the first (only) token, and the request's finished output."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    _ttft.n = getattr(_ttft, "n", 0) + 1  # type: ignore[attr-defined]
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                        extra_args={"kv_transfer_params": params} if params else None)
    start = time.perf_counter()
    engine.add_request(f"b{_ttft.n}", TokensPrompt(prompt_token_ids=tokens), sp)  # type: ignore[attr-defined]
    while True:
        for out in engine.step():
            if out.finished:
                return time.perf_counter() - start, out


def _raw_wire_s(nbytes: int, repeats: int = 3) -> float:
    """Median seconds to move ``nbytes`` over a loopback TCP socket (one connection, sendall / recv_into)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    payload = os.urandom(min(nbytes, 1 << 20)) * -(-nbytes // (1 << 20))

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            for _ in range(repeats):
                conn.recv(1)
                conn.sendall(memoryview(payload)[:nbytes])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    times = []
    buf = bytearray(nbytes)
    with socket.create_connection(("127.0.0.1", port)) as client:
        for _ in range(repeats):
            start = time.perf_counter()
            client.sendall(b"x")
            view, got = memoryview(buf), 0
            while got < nbytes:
                got += client.recv_into(view[got:])
            times.append(time.perf_counter() - start)
    thread.join()
    server.close()
    return statistics.median(times)


def _decode_gaps(engine: Any, tokens: list[int], params: dict[str, Any], n: int,
                 concurrent: Callable[[], None] | None, start_at: int = 4) -> list[float]:
    """Seconds between the tokens of one greedy ``n``-token request on ``engine`` (a handed-off prompt), from
    its ``start_at``-th token on; ``concurrent`` starts other work when that token arrives. Other requests
    of ``engine`` are run to the end before returning."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    _decode_gaps.n = getattr(_decode_gaps, "n", 0) + 1  # type: ignore[attr-defined]
    rid = f"itl{_decode_gaps.n}"  # type: ignore[attr-defined]
    engine.add_request(rid, TokensPrompt(prompt_token_ids=tokens), SamplingParams(
        max_tokens=n, temperature=0.0, ignore_eos=True, extra_args={"kv_transfer_params": params}))
    stamps: list[float] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != rid:
                continue
            now = time.perf_counter()
            stamps += [now] * (len(out.outputs[0].token_ids) - len(stamps))
            if concurrent is not None and len(stamps) >= start_at:
                concurrent()
                concurrent = None
    return [b - a for a, b in zip(stamps[start_at - 1:], stamps[start_at:])]


def _start_prefills(engine: Any, longs: list[list[int]], tag: str, threads: list[threading.Thread] | None) -> None:
    """Long prompts (one output token each): added to ``engine``'s own queue (``threads`` None: it is the engine
    stepping already), or run on it by a thread of their own (appended to ``threads``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if threads is None:
        for k, ids in enumerate(longs):
            engine.add_request(f"{tag}-{k}", TokensPrompt(prompt_token_ids=ids),
                               SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        return
    threads.append(threading.Thread(target=lambda: [_ttft(engine, ids) for ids in longs]))
    threads[-1].start()


def _itl(producer: Any, consumer: Any, long_tokens: int, repeats: int) -> dict[str, dict[str, float]]:
    """The decode instance's inter-token latency with nothing else running, with long prefills run by the
    decoding instance itself (colocated serving), and with the same prefills run by the producer at the same
    time (disaggregated; on this machine the producer shares the cores)."""
    out: dict[str, dict[str, float]] = {}
    for arm in ("alone", "colocated", "disaggregated"):
        p50, p95, worst = [], [], []
        for r in range(repeats):
            prompt = _prompt(7000 + r, 1024)
            params = _ttft(producer, prompt)[1].kv_transfer_params
            longs = [_prompt(8000 + 10 * r + k, long_tokens) for k in range(2)]
            threads: list[threading.Thread] = []
            start = None if arm == "alone" else functools.partial(
                _start_prefills, *((consumer, longs, f"long-{r}", None) if arm == "colocated" else
                                   (producer, longs, f"long-{r}", threads)))
            gaps = _decode_gaps(consumer, prompt, params, 96, start)
            for thread in threads:
                thread.join()
            p50.append(statistics.median(gaps))
            p95.append(sorted(gaps)[int(0.95 * (len(gaps) - 1))])
            worst.append(max(gaps))
        out[arm] = {"p50_ms": 1e3 * statistics.median(p50), "p95_ms": 1e3 * statistics.median(p95),
                    "max_ms": 1e3 * statistics.median(worst)}
    return out


def _read_seconds(metrics: dict[str, float], wire: str) -> float:
    return metrics.get(f'kvengine_tier_read_seconds_sum{{tier="peers_{wire}"}}', 0.0)


def _pair(model: str, wire: str, capacity: str, max_len: int) -> tuple[Any, Any, int]:
    """A producer and a consumer speaking ``wire``, both warmed up; and the consumer's metrics port."""
    handoff, pport, cport = _free_port(), _free_port(), _free_port()
    producer = _engine(model, "kv_producer", {
        "kvengine": {"memory": {"capacity_bytes": capacity}, "metrics_port": pport, "lease_seconds": 120,
                     "peers": {"transport": wire}},
        "handoff": {"listen": f"127.0.0.1:{handoff}"}}, max_len)
    try:
        consumer = _engine(model, "kv_consumer", {"kvengine": {
            "memory": {"capacity_bytes": capacity}, "metrics_port": cport,
            "peers": {"peers": [f"127.0.0.1:{handoff}"], "request_timeout": 30.0, "read_deadline": 60.0,
                      "transport": wire}}}, max_len)
    except BaseException:
        producer.engine_core.shutdown()
        raise
    _ttft(producer, _prompt(1, 64))  # warm-up, both
    _ttft(consumer, _prompt(2, 64))
    return producer, consumer, cport


def _handoffs(producer: Any, consumer: Any, cport: int, wire: str, n: int, repeats: int) -> dict[str, Any]:
    """The handoff of ``n``-token prompts over ``wire`` against computing them (medians of ``repeats``)."""
    sample: dict[str, list[float]] = {"prefill": [], "handoff": [], "transfer": [], "local": []}
    cached = []
    for r in range(repeats):
        tokens = _prompt(1000 * n + r, n)
        t, out = _ttft(producer, tokens)
        sample["prefill"].append(t)
        before = _read_seconds(scrape(cport), wire)
        t, got = _ttft(consumer, tokens, out.kv_transfer_params)
        sample["handoff"].append(t)
        sample["transfer"].append(_read_seconds(scrape(cport), wire) - before)
        cached.append(int(got.num_cached_tokens or 0))
        sample["local"].append(_ttft(consumer, _prompt(2000 * n + r, n))[0])
    med = {k: statistics.median(v) for k, v in sample.items()}
    nbytes = (n - 1) * KV_BYTES_PER_TOKEN
    raw = _raw_wire_s(nbytes)
    return {"wire": wire, "tokens": n, "kv_bytes": nbytes, "cached_tokens": cached,
            **{f"{k}_s": v for k, v in med.items()},
            "raw_wire_s": raw, "transfer_share_of_ttft": med["transfer"] / med["handoff"],
            "raw_over_transfer": raw / med["transfer"] if med["transfer"] else None,
            "local_over_handoff": med["local"] / med["handoff"],
            "transfer_gb_s": nbytes / med["transfer"] / 1e9 if med["transfer"] else None,
            "raw_wire_gb_s": nbytes / raw / 1e9}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--wires", nargs="+", choices=("tcp", "zmq", "ucx"), default=["tcp"],
                   help="peer wires to hand off over, a pair of engines each (the first also measures ITL)")
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from kvengine.integrations.vllm.tiny_models import build_model_dir

    print_header()
    max_len = max(args.sizes) + 64
    work = Path(tempfile.mkdtemp(prefix="bench-disagg-"))
    model = str(build_model_dir(work / "model", "llama", vocab_size=4096, dtype="float32", **MODEL,
                                max_position_embeddings=max_len))
    capacity = f"{max(256, 4 * max(args.sizes) * args.repeats * KV_BYTES_PER_TOKEN >> 20)}MiB"
    results, itl = [], {}
    for wire in args.wires:
        producer, consumer, cport = _pair(model, wire, capacity, max_len)
        try:
            results += [_handoffs(producer, consumer, cport, wire, n, args.repeats) for n in args.sizes]
            if wire == args.wires[0]:
                itl = _itl(producer, consumer, max(args.sizes), args.repeats)
        finally:
            for engine in (consumer, producer):
                engine.engine_core.shutdown()
    rows = [[r["wire"], r["tokens"], f"{r['kv_bytes'] / 2**20:.1f}", f"{r['prefill_s'] * 1e3:.0f}",
             f"{r['handoff_s'] * 1e3:.0f}", f"{r['transfer_s'] * 1e3:.1f}", f"{r['transfer_share_of_ttft']:.2f}",
             f"{r['local_s'] * 1e3:.0f}", f"{r['local_over_handoff']:.1f}", f"{r['transfer_gb_s'] or 0:.2f}",
             f"{r['raw_wire_gb_s']:.2f}", min(r["cached_tokens"]) == max(r["cached_tokens"]) == r["tokens"] - 1]
            for r in results]
    print_table("prefill/decode handoff (medians; ms unless said)",
                ["wire", "tokens", "KV MiB", "prefill TTFT", "handoff TTFT", "transfer", "transfer/TTFT",
                 "local TTFT", "local/handoff", "transfer GB/s", "raw wire GB/s", "all but last loaded"], rows)
    print_table(f"decode instance's inter-token latency ({args.wires[0]}), 96-token reply of a handed-off "
                f"1,024-token prompt; two {max(args.sizes)}-token prefills start at its 4th token (medians of "
                f"{args.repeats}; ms)",
                ["prefills run", "ITL p50", "ITL p95", "ITL max"],
                [[{"alone": "none", "colocated": "by the decoding instance (colocated)",
                   "disaggregated": "by the producer (disaggregated, same cores)"}[arm],
                  f"{v['p50_ms']:.1f}", f"{v['p95_ms']:.1f}", f"{v['max_ms']:.0f}"] for arm, v in itl.items()])
    path = write_json("disagg.json", {"machine": machine_info().as_dict(), "model": MODEL, "dtype": "float32",
                                      "repeats": args.repeats, "results": results, "itl": itl})
    print(f"results: {path}")


if __name__ == "__main__":
    main()

"""Scheduler-side latency of the vLLM connector's ``get_num_new_matched_tokens``, before and after the
non-blocking probe (issue 14), side by side in one run.

    .venv/bin/python benchmarks/bench_vllm_lookup.py [--rounds 3] [--requests 16] [--before-rev e3d4aea]

The arms run in ``.venv-vllm`` (the connector's modules import vLLM; ``--python`` to change it).

The connector's real scheduler half, channel and worker-side reservation desk run on a real engine
with a disk tier, in two processes as vLLM runs them on CPU; no vLLM engine (the scheduler loop is
simulated: every step asks each request still waiting, as vLLM's scheduler does). 16 requests arrive at once, each with a 4-chunk prompt
whose chunks sit on disk only (a fresh engine on the directory, page cache dropped): the cold-disk
case. Per call: how long the scheduler was held. Reported per arm: p50 / p99 / max call latency,
the steps until every request was answered, and wall time; "before" is the code at ``--before-rev``
(one lookup served at a time, every ask waiting up to 200 ms), "after" the working tree. Arms run in
separate processes, alternating, on the same records.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(__file__))
from _util import drop_caches, print_header, print_table, snapshot, write_json

ROOT = Path(__file__).resolve().parents[1]
CHUNK, CHUNKS, LAYERS = 256, 4, 8
SHAPE = (2, 8, CHUNK, 64)  # K and V, 8 heads, 64 dims: 1 MiB of fp32 per layer and chunk
#: Batches of the warm phase (16 requests each): enough calls for a p99.
WARM_ROUNDS = 10


def layout():
    import torch

    from kvengine import ChunkLayout, KVCategory, TensorSpec

    return ChunkLayout(CHUNK, tuple(TensorSpec(name=f"l{i}", group=0, category=KVCategory.FULL_ATTENTION,
                                               dtype=torch.float32, shape=SHAPE, token_dim=2)
                                    for i in range(LAYERS)))


def config(disk: str) -> dict:
    return {"chunk_size": CHUNK, "memory": {"capacity_bytes": "1GiB"}, "disk": {"path": disk, "fsync": "never"}}


def prompts(n: int) -> list[list[int]]:
    return [[1000 * (r + 1) + t for t in range(CHUNKS * CHUNK + 1)] for r in range(n)]


def prepare(disk: str, n: int) -> None:
    """Store every prompt's chunks on disk (write-through), then close: memory forgets them."""
    import torch

    from kvengine import KVEngine, Namespace

    cfg = {**config(disk), "write_mode": "write_through"}
    with KVEngine(cfg) as engine:
        binding = engine.bind(Namespace(model="bench-lookup"), layout())
        for tokens in prompts(n):
            engine.store(binding, tokens[: CHUNKS * CHUNK],
                         lambda i, s, e: [torch.full(SHAPE, float(i)) for _ in range(LAYERS)])


def worker(disk: str) -> None:
    """The worker half in a process of its own, as vLLM runs it: engine, reservation desk, channel."""
    from kvengine import KVEngine, Namespace
    from kvengine.integrations.vllm.channel import LookupService
    from kvengine.integrations.vllm.worker import ReservationDesk

    engine = KVEngine(config(disk))
    desk = ReservationDesk(engine, Namespace(model="bench-lookup"), layout())
    service = LookupService(desk)
    path, key = service.start()
    print(path, key.hex(), flush=True)
    sys.stdin.read()  # until the scheduler half is done
    service.close()
    engine.close(flush=False)


def arm(disk: str, n: int) -> dict:
    """One arm (whichever code is on sys.path): the scheduler half here, the worker half in a child."""
    from kvengine.integrations.vllm.metadata import ChannelAddress
    from kvengine.integrations.vllm.options import ConnectorOptions
    from kvengine.integrations.vllm.scheduler import SchedulerSide

    wait = ConnectorOptions.from_extra_config({}).lookup_wait_s  # the connector's default
    child = subprocess.Popen([sys.executable, __file__, "--worker", disk], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    path, key = child.stdout.readline().split()
    sched = SchedulerSide(chunk_size=CHUNK, asynchronous=False, lookup_wait_s=wait)
    sched.connect([ChannelAddress(path, bytes.fromhex(key), child.pid)])
    phases = {"cold": _ask_until_answered(sched, prompts(n), ["cold"]),
              "warm": _ask_until_answered(sched, prompts(n), [f"warm{i}-" for i in range(WARM_ROUNDS)])}
    sched.shutdown()
    child.stdin.close()
    child.wait(60)
    return {"lookup_wait_ms": 1e3 * wait, **{f"{phase}_{k}": v for phase, r in phases.items() for k, v in r.items()}}


def _ask_until_answered(sched, token_lists: list[list[int]], tags: list[str]) -> dict:
    """Per tag, a batch of requests (one per token list) arriving at once; vLLM's loop over the waiting
    ones, step after step, until each got an answer; then each hit is declined (released), as when vLLM
    schedules no external tokens. Latencies of every call of every batch, steps and wall time summed."""
    calls: list[float] = []
    matched: dict[str, int] = {}
    steps = 0
    wall = 0.0
    for tag in tags:
        requests = [SimpleNamespace(request_id=f"{tag}{i}", num_tokens=len(t), all_token_ids=t, prompt_token_ids=t,
                                    num_prompt_tokens=len(t), mm_features=[], lora_request=None, cache_salt=None,
                                    skip_reading_prefix_cache=False, pooling_params=None, prompt_embeds=None)
                    for i, t in enumerate(token_lists)]
        t0 = time.perf_counter()
        while any(r.request_id not in matched for r in requests) and steps < 100_000:
            steps += 1
            for req in requests:
                if req.request_id in matched:
                    continue
                c0 = time.perf_counter()
                got, _ = sched.get_num_new_matched_tokens(req, 0)
                calls.append(time.perf_counter() - c0)
                if got is not None:
                    matched[req.request_id] = got
            time.sleep(0.002)  # the rest of a scheduler step (a forward pass is far longer)
        wall += time.perf_counter() - t0
        for req in requests:
            sched.update_state_after_alloc(req, None, 0)  # declined: released
    calls.sort()
    return {"p50_ms": 1e3 * statistics.median(calls), "p99_ms": 1e3 * calls[min(len(calls) - 1, int(0.99 * len(calls)))],
            "max_ms": 1e3 * calls[-1], "calls": len(calls), "steps": steps, "wall_s": wall,
            "hit_tokens": sum(matched.values())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--before-rev", default="e3d4aea", help="the code of the 'before' arm")
    p.add_argument("--python", default=str(ROOT / ".venv-vllm/bin/python"), help="interpreter of the arms")
    p.add_argument("--arm", nargs=2, metavar=("DISK", "N"), help=argparse.SUPPRESS)
    p.add_argument("--worker", metavar="DISK", help=argparse.SUPPRESS)
    p.add_argument("--prepare", nargs=2, metavar=("DISK", "N"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker)
        return
    if args.prepare:
        prepare(args.prepare[0], int(args.prepare[1]))
        return
    if args.arm:
        print(json.dumps(arm(args.arm[0], int(args.arm[1]))))
        return
    print_header()
    with tempfile.TemporaryDirectory() as work:
        before = snapshot(args.before_rev, Path(work) / "before")
        envs = {"before": dict(os.environ, PYTHONPATH=str(before)), "after": dict(os.environ)}
        # Each arm writes its records with its own code (the record format may differ between them).
        disks = {name: os.path.join(work, f"disk-{name}") for name in envs}
        for name, disk in disks.items():
            subprocess.run([args.python, __file__, "--prepare", disk, str(args.requests)], env=envs[name], cwd=work,
                           check=True, capture_output=True)
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        for r in range(args.rounds):
            for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
                disk = disks[name]
                drop_caches([f for f in Path(disk).rglob("*") if f.is_file()])
                out = subprocess.run([args.python, __file__, "--arm", disk, str(args.requests)], env=envs[name],
                                     cwd=work, check=True, capture_output=True, text=True).stdout
                runs[name].append(json.loads(out.strip().splitlines()[-1]))
    keys = [k for k in runs["after"][0] if k != "lookup_wait_ms"]
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in runs["after"][0]} for name, rs in runs.items()}
    for phase, what in (("cold", "chunks on disk only, page cache dropped"), ("warm", "the same prompts again: "
                                                                                      "answered from memory")):
        cols = [k for k in keys if k.startswith(phase)]
        print_table(f"get_num_new_matched_tokens, {args.requests} concurrent requests, {what} "
                    f"(medians of {args.rounds} rounds)", ["arm", "lookup_wait_ms", *(c[len(phase) + 1:] for c in cols)],
                    [[name, m["lookup_wait_ms"], *(m[c] for c in cols)] for name, m in medians.items()])
    for phase in ("cold", "warm"):
        b, a = medians["before"], medians["after"]
        print(f"{phase}: p99 after / before {a[f'{phase}_p99_ms'] / b[f'{phase}_p99_ms']:.3f}, "
              f"max after / before {a[f'{phase}_max_ms'] / b[f'{phase}_max_ms']:.3f}, "
              f"wall after / before {a[f'{phase}_wall_s'] / b[f'{phase}_wall_s']:.2f}")
    path = write_json("vllm_lookup.json", {"runs": runs, "medians": medians, "before_rev": args.before_rev})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""What sharing MLA loads across tensor-parallel ranks costs (integrations/vllm/replica.py).

Two processes over a real gloo group, as two vLLM workers at tensor_parallel_size=2: a load of ``--chunks``
chunks of an MLA model (576-wide bf16 latent pages of 128 tokens, ``--layers`` layers) copied into paged
caches, layer by layer on the load pipeline, timed two ways in interleaved rounds:

* local: rank 0 alone copies its chunks into its pages (the TP=1 path, and the floor);
* shared: rank 0 copies and broadcasts every chunk, rank 1 receives and copies it into its pages.

Prints the load's bytes per second on each rank and the shared/local time ratio, and checks that both
ranks' pages end byte-identical; writes ``results/mla_tp.json`` (or ``--out``).

    .venv/bin/python benchmarks/bench_mla_tp.py [--chunks 16] [--layers 8] [--rounds 15]
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import print_header, print_table, write_json

BLOCK, CHUNK, WIDTH = 128, 256, 576


def _setup(layers: int, chunks: int) -> tuple[Any, Any, Any, Any]:
    import torch

    from kvengine.chunks.layout import ChunkLayout, TensorSpec
    from kvengine.integrations.vllm.layout import GroupKind, GroupPlan, PagedLayout, PagedTensor
    from kvengine.integrations.vllm.paging import PagedCopier

    names = tuple(f"layer{i}" for i in range(layers))
    group = GroupPlan(group_id=0, kind=GroupKind.MLA, block_size=BLOCK, layer_names=names)
    pages = CHUNK // BLOCK
    specs = tuple(TensorSpec(name=n, group=0, category=group.category, dtype=torch.bfloat16,
                             shape=(pages, BLOCK, WIDTH), token_dim=None) for n in names)
    tensors = tuple(PagedTensor(layer=n, group_id=0, kind=GroupKind.MLA, kernel_ratio=1, pages=pages) for n in names)
    layout = PagedLayout(ChunkLayout(CHUNK, specs), tensors, (group,), "bench-mla", "fp")
    blocks = chunks * pages
    caches = {n: torch.zeros(blocks + 1, BLOCK, WIDTH, dtype=torch.bfloat16) for n in names}
    spec = SimpleNamespace(request_id="r", salt="", start=0, end=chunks * CHUNK, asynchronous=False,
                           block_ids=(tuple(range(1, blocks + 1)),))
    return layout, PagedCopier(layout, caches), spec, caches


def _rank(rank: int, store: str, args: dict[str, int], out: Any) -> None:
    import torch
    import torch.distributed as dist

    from kvengine.integrations.vllm.pipeline import LayerPipeline, LoadJob
    from kvengine.integrations.vllm.replica import LatentBroadcast
    from kvengine.types import ChunkView

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    layout, copier, spec, caches = _setup(args["layers"], args["chunks"])
    order = list(range(args["layers"]))
    shared = LayerPipeline(copier, order, LatentBroadcast.create(rank, layout.chunk))
    local = LayerPipeline(copier, order)
    views = tuple(ChunkView(c, None, (c * CHUNK, (c + 1) * CHUNK),  # type: ignore[arg-type]
                            tuple(torch.randn(s.shape).to(s.dtype) for s in layout.chunk.tensors), layout.chunk)
                  for c in range(args["chunks"]))

    def load(pipe: LayerPipeline) -> float:
        job = LoadJob(spec, None, views, 0) if rank == 0 else LoadJob.mirrored(spec, 0)
        dist.barrier()
        t0 = time.perf_counter()
        pipe.begin_loads([job])
        (job,) = pipe.end_loads()
        elapsed = time.perf_counter() - t0
        assert job.loaded == args["chunks"], job.loaded
        return elapsed

    times: dict[str, list[float]] = {"local": [], "shared": []}
    for _ in range(args["rounds"]):
        if rank == 0:
            times["local"].append(load(local))
        else:
            dist.barrier()  # rank 1 idles while rank 0 loads alone
        times["shared"].append(load(shared))
    shared.close()
    local.close()
    digest = hashlib.sha256()
    for cache in caches.values():  # after a shared load: both ranks hold the same pages
        digest.update(cache.view(torch.uint8).numpy().tobytes())
    out.put((rank, {**times, "digest": digest.hexdigest()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path("mla_tp.json"), help="under results/ unless absolute")
    args = vars(parser.parse_args())
    out_path = args.pop("out")
    print_header()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, f"{tmp}/store", args, out)) for r in (0, 1)]
        for p in procs:
            p.start()
        results = dict(out.get(timeout=600) for _ in procs)
        for p in procs:
            p.join(60)
    nbytes = args["chunks"] * args["layers"] * CHUNK * WIDTH * 2
    local = statistics.median(results[0]["local"])
    shared = {r: statistics.median(results[r]["shared"]) for r in (0, 1)}
    rows = [["rank 0 alone (local copy)", local * 1e3, nbytes / local / 1e9, 1.0],
            ["rank 0, shared (copy + send)", shared[0] * 1e3, nbytes / shared[0] / 1e9, shared[0] / local],
            ["rank 1, shared (receive + copy)", shared[1] * 1e3, nbytes / shared[1] / 1e9, shared[1] / local]]
    print_table(f"one load of {args['chunks']} chunks x {args['layers']} layers ({nbytes / 1e6:.1f} MB per rank), "
                f"medians of {args['rounds']} interleaved rounds",
                ["path", "ms", "GB/s", "time vs local"], rows)
    exact = results[0]["digest"] == results[1]["digest"]
    print(f"\nboth ranks' pages byte-identical after the shared loads: {exact}")
    write_json(out_path, {"args": args, "bytes": nbytes, "exact": exact,
                               "local_s": results[0]["local"], "shared_s": {str(r): results[r]["shared"]
                                                                           for r in (0, 1)},
                               "median_s": {"local": local, "shared_rank0": shared[0], "shared_rank1": shared[1]}})


if __name__ == "__main__":
    main()

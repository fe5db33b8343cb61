"""The GPU path: store and retrieve through the engine with KV on a CUDA device and a pinned host arena.

Ratios to torch's own device-to-host and host-to-device copies of the same bytes into and out of
pinned host memory, measured side by side in every round (raw D2H, store, raw H2D, retrieve), for
the two layouts the integrations use: one stacked ``[L, 2, T, H, D]`` tensor per chunk, and one
tensor per layer (vLLM's pages, HF's per-layer caches). Every retrieve is checked byte for byte.

Then correctness on the device (``gpu_checks.py``): the Hugging Face proof of ``kvengine verify hf``
on three tiny families with the model and its cache on the device, and the vLLM worker's device
self-check against tensors laid out as the GPU attention backends register them (built by hand: the
GPU machine has no vLLM), each with a planted layout error that must be caught.

Last, the vLLM connector on the device's attention backend, started once on a tiny model: without a
verification record of that platform it must refuse (``integrations/vllm/acceptance.py``). That part
needs vLLM's CUDA build; where vLLM is absent or not a CUDA build it is reported as skipped.

Usage::

    python benchmarks/bench_gpu.py                          # on a CUDA machine (scripts/gpu_run.sh)
    python benchmarks/bench_gpu.py --device cpu --tokens 2048 --layers 4 --skip-vllm   # a smoke run here

Writes ``benchmarks/results/gpu.json``; exits 1 when a retrieve, a proof or a self-check is not exact.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvengine

try:
    import kvengine.integrations
except ModuleNotFoundError:  # a source tree that is not installed (the GPU machine): pyproject's package-dir
    kvengine.__path__.append(str(Path(__file__).resolve().parents[1]))  # integrations/, transports/

from _util import median_time, print_header, print_table, write_json
from bench_core import CHUNK, per_layer_layout, stacked_layout  # the CPU benchmark's layouts (bf16)
from gpu_checks import hf_on_device, self_check_on_device

from kvengine import KVEngine, Namespace
from kvengine.core.copies import copy_all


class DeviceCase:
    """One prompt's KV on the device; the engine's arena (pinned where CUDA is) and a pinned raw buffer."""

    def __init__(self, device: torch.device, tokens: int, layers: int, heads: int, dim: int,
                 per_layer: bool) -> None:
        self.device = device
        self.per_layer = per_layer
        self.tokens = torch.randint(0, 150_000, (tokens,))
        self.src = torch.randn(layers, 2, tokens, heads, dim, device=device).to(torch.bfloat16)
        self.dst = torch.zeros_like(self.src)
        pinned = device.type == "cuda"
        self.host = torch.empty(self.src.shape, dtype=self.src.dtype, pin_memory=pinned)
        self.nbytes = self.src.numel() * self.src.element_size()
        self.layout = (per_layer_layout if per_layer else stacked_layout)(layers, heads, dim)
        capacity = self.layout.nbytes() * (tokens // CHUNK) + (256 << 20)
        self.engine = KVEngine({"chunk_size": CHUNK, "lease_seconds": 600,
                                "memory": {"capacity_bytes": capacity, "prefault": True}}, transports=[])
        self.arena_pinned = self.engine._core.memory.pinned
        self.round = 0
        self.binding: Any = None

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def source(self, i: int, s: int, e: int) -> list[torch.Tensor]:
        return list(self.src[:, :, s:e].unbind(0)) if self.per_layer else [self.src[:, :, s:e]]

    def sink(self, view: Any) -> None:
        s, e = view.token_range
        copy_all(list(self.dst[:, :, s:e].unbind(0)) if self.per_layer else [self.dst[:, :, s:e]], view.tensors)

    def fresh_keys(self) -> None:
        self.round += 1
        self.binding = self.engine.bind(Namespace(model="bench-gpu", cache_salt=str(self.round)), self.layout)

    def raw_d2h(self) -> None:
        self.host.copy_(self.src)
        self.sync()

    def raw_h2d(self) -> None:
        self.dst.copy_(self.host)
        self.sync()

    def store(self) -> None:
        st = self.engine.store(self.binding, self.tokens, self.source)
        self.sync()
        assert st.stored_chunks == len(self.tokens) // CHUNK, st

    def retrieve(self) -> None:
        res = self.engine.lookup(self.binding, f"r{self.round}", self.tokens)
        result = self.engine.load(res, self.sink)
        self.sync()
        assert result.ok and result.loaded_tokens == len(self.tokens), result


def bench_layout(device: torch.device, args: argparse.Namespace, per_layer: bool) -> dict[str, Any]:
    case = DeviceCase(device, args.tokens, args.layers, args.heads, args.dim, per_layer)
    try:
        case.fresh_keys()
        case.store()  # warm-up: first touch of every page on every path
        case.retrieve()
        rounds = []
        for _ in range(args.repeats):
            d2h = median_time(case.raw_d2h, 1)
            case.fresh_keys()
            store = median_time(case.store, 1)
            h2d = median_time(case.raw_h2d, 1)
            case.dst.zero_()
            case.sync()
            retrieve = median_time(case.retrieve, 1)
            rounds.append((d2h, store, h2d, retrieve))
        exact = bool(torch.equal(case.dst, case.src))
    finally:
        case.engine.close()
    gb = case.nbytes / 1e9
    med = [statistics.median(r[i] for r in rounds) for i in range(4)]
    return {"layout": "per-layer tensors" if per_layer else "stacked [L,2,T,H,D]", "gb": gb,
            "arena_pinned": case.arena_pinned, "exact": exact,
            "raw_d2h_gbps": gb / med[0], "store_gbps": gb / med[1], "raw_h2d_gbps": gb / med[2],
            "retrieve_gbps": gb / med[3],
            "store_over_d2h": statistics.median(r[0] / r[1] for r in rounds),
            "retrieve_over_h2d": statistics.median(r[2] / r[3] for r in rounds), "rounds_s": rounds}


def vllm_connector_on_device(device: torch.device) -> dict[str, Any]:
    """Start vLLM with the kvengine connector on the device's default attention backend, once."""
    try:
        import vllm
        from vllm.platforms import current_platform
    except ImportError as exc:
        return {"status": "skipped", "why": f"vLLM is not installed ({exc})"}
    if device.type != "cuda" or not current_platform.is_cuda():
        return {"status": "skipped", "why": f"vLLM {vllm.__version__} here is not a CUDA build"}
    import tempfile

    from kvengine.integrations.vllm.tiny_models import build_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        model = build_model_dir(Path(tmp) / "llama", "llama", dtype="bfloat16")
        kv = {"kv_connector": "KVEngineConnector", "kv_connector_module_path": "kvengine.integrations.vllm.connector",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"kvengine": {"memory": {"capacity_bytes": "1GiB"}}}}
        try:
            llm = vllm.LLM(model=str(model), dtype="bfloat16", max_model_len=2048, enforce_eager=True,
                           gpu_memory_utilization=0.2, kv_transfer_config=kv)
        except Exception as exc:  # the expected answer: no verification record of this platform
            return {"status": "refused", "why": f"{type(exc).__name__}: {exc}"[:500]}
        del llm
    return {"status": "started", "why": "the connector accepted a GPU backend without a verification record"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke run")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--out", default="gpu.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_gpu: no CUDA device here (torch.cuda.is_available() is False); "
                         "run it on a CUDA machine, or with --device cpu for a smoke run")
    print_header()
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    runs = [bench_layout(device, args, per_layer=False), bench_layout(device, args, per_layer=True)]
    rows: list[list[object]] = []
    for r in runs:
        rows += [[f"raw D2H into pinned host ({r['gb']:.2f} GB)", r["raw_d2h_gbps"], "1.00", ""],
                 [f"store, {r['layout']}", r["store_gbps"], f"{r['store_over_d2h']:.2f}", ""],
                 ["raw H2D from pinned host", r["raw_h2d_gbps"], "1.00", ""],
                 [f"retrieve, {r['layout']}", r["retrieve_gbps"], f"{r['retrieve_over_h2d']:.2f}",
                  "exact" if r["exact"] else "NOT EXACT"]]
    print_table(f"engine <-> {device.type} KV, {args.tokens} tokens, {args.layers} layers x {args.heads} heads x "
                f"{args.dim}, bf16, arena pinned: {runs[0]['arena_pinned']} (medians of {args.repeats})",
                ["what", "GB/s", "ratio to raw", "check"], rows)
    hf = hf_on_device(device)
    print_table(f"kvengine verify hf's proof, model and cache on {device.type}", ["family", "verdicts", "tokens loaded"],
                [[c["family"], "EXACT" if c["ok"] else c.get("failure") or c.get("error"), c.get("tokens_loaded", 0)]
                 for c in hf])
    checks = self_check_on_device(device)
    print_table(f"vLLM device self-check on hand-built GPU backend layouts ({device.type} tensors)",
                ["backend", "layout", "outcome", "planted error caught", "ms"],
                [[c["backend"], c["layout"], c.get("outcome", c.get("error")), c.get("planted_error_caught"),
                  1000 * c.get("seconds", 0.0)] for c in checks])
    connector = {"status": "skipped", "why": "--skip-vllm"} if args.skip_vllm else vllm_connector_on_device(device)
    print(f"\nvLLM connector on the device's attention backend: {connector['status']}: {connector['why']}")
    path = write_json(args.out, {"device": str(device), "tokens": args.tokens, "runs": runs, "hf": hf,
                                 "self_check": checks, "vllm": connector})
    print(f"wrote {path}")
    return 0 if all(r["exact"] for r in runs) and all(c["ok"] for c in hf + checks) else 1


if __name__ == "__main__":
    sys.exit(main())

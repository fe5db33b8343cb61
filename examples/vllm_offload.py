"""kvengine as vLLM's KV cache offload: prompts sharing a long prefix, checked against plain vLLM.

    .venv-vllm/bin/python examples/vllm_offload.py                    # a tiny random Llama, built locally
    .venv-vllm/bin/python examples/vllm_offload.py --model /path/to/hf/model --disk /var/cache/kv

It runs the same prompts three times: on vLLM without the connector (the
reference), then with kvengine as vLLM's KV connector, cold (the first
request computes the shared prefix and stores it; the later ones load it)
and warm (every prompt loads all its full chunks). It prints the tokens each
request loaded from kvengine and exits 1 unless the greedy outputs of both
connector passes are identical to the reference (or if the warm pass loaded
nothing). vLLM's own prefix cache is off, so every hit comes from kvengine.

With ``--disk DIR`` the disk tier outlives the run: run it twice and the
second process's cold pass already loads the prefix from disk. Without it,
a temporary directory is used and removed.

Needs vLLM (``pip install 'kvengine[vllm]'``; on CPU-only machines see
docs/vllm.md for the install notes). vLLM's CPU build refuses to start
without ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache); when it is unset this
script sets it to 1 and says so.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

INSTALL = "pip install 'kvengine[vllm]' (CPU-only machines: see docs/vllm.md)"
DEFAULT_KVCACHE_GIB = "1"  # ample for the tiny model (~1 KiB of KV per token); raise it for a real model


def require(module: str, install: str) -> None:
    """Exit 2 with one line naming the install command when ``module`` is not installed."""
    import importlib

    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != module:
            raise  # installed but broken: the real error says more than an install hint
        print(f"examples/vllm_offload.py needs {module}, which is not installed; install it with: {install}",
              file=sys.stderr)
        sys.exit(2)


def kv_transfer_config(disk: str, chunk_size: int | str) -> dict:
    """The whole integration is this dict (see docs/vllm.md for every setting)."""
    return {
        "kv_connector": "KVEngineConnector",
        "kv_connector_module_path": "kvengine.integrations.vllm.connector",
        "kv_role": "kv_both",
        # A cache fault (say a corrupt disk record) must make vLLM recompute, never fail the request.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "kvengine": {  # an EngineConfig; KVENGINE_* environment variables override it
                # "auto": derived from the block sizes vLLM picks (they differ by model and CPU);
                # a number must be a multiple of every block size, or the connector refuses to start.
                "chunk_size": chunk_size,
                "memory": {"capacity_bytes": "1GiB"},
                "disk": {"path": disk, "capacity_bytes": "8GiB"},
            },
        },
    }


def make_prompts(vocab: int, requests: int) -> list[list[int]]:
    """``requests`` prompts: one shared 1500-token "system prompt", then a different question each."""
    rng = random.Random(0)
    system = [rng.randrange(3, vocab) for _ in range(1500)]
    return [system + [rng.randrange(3, vocab) for _ in range(100 + 10 * i)] for i in range(requests)]


def run_pass(llm: Any, name: str, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Generate greedily, one request at a time; return the outputs and the prompt tokens loaded from kvengine."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outputs, hits = [], 0
    for i, prompt in enumerate(prompts):
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
        loaded = int(out.num_cached_tokens or 0)
        outputs.append(list(out.outputs[0].token_ids))
        hits += loaded
        what = "" if name == "reference" else f", {loaded} loaded from kvengine"
        print(f"{name:>9} request {i}: {len(prompt)} prompt tokens{what}, {time.perf_counter() - t:.2f} s")
    return outputs, hits


def shutdown(llm: Any) -> None:
    """Stop the engine's processes before starting the next engine."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model directory or id (default: a tiny random Llama built here)")
    ap.add_argument("--disk", default=None, help="disk tier directory, kept after the run "
                    "(default: a temporary directory, removed at exit)")
    ap.add_argument("--chunk-size", type=lambda v: v if v == "auto" else int(v), default="auto",
                    help="tokens per chunk, or 'auto' (default)")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--dtype", default="float32", help="model dtype for vLLM (default float32)")
    args = ap.parse_args()

    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:  # read by the engine processes vLLM spawns
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = DEFAULT_KVCACHE_GIB
        print(f"VLLM_CPU_KVCACHE_SPACE was not set: set it to {DEFAULT_KVCACHE_GIB} (GiB of KV cache for vLLM's "
              "CPU build); export it to choose another size")
    require("vllm", INSTALL)
    from vllm import LLM

    model = args.model
    if model is None:
        from kvengine.integrations.vllm.tiny_models import build_model_dir

        model = str(build_model_dir(Path(tempfile.gettempdir()) / "kvengine-tiny-llama", "llama"))
    engine_args = dict(model=model, dtype=args.dtype, max_model_len=4096, enforce_eager=True,
                       enable_prefix_caching=False, seed=0)

    llm = LLM(**engine_args)  # the reference: plain vLLM, no connector
    prompts = make_prompts(llm.get_tokenizer().vocab_size, args.requests)
    reference, _ = run_pass(llm, "reference", prompts)
    shutdown(llm)

    with tempfile.TemporaryDirectory(prefix="kvengine-vllm-example-") as tmp:
        disk = args.disk or tmp
        llm = LLM(**engine_args, kv_transfer_config=kv_transfer_config(disk, args.chunk_size))
        cold, cold_hits = run_pass(llm, "cold", prompts)
        warm, warm_hits = run_pass(llm, "warm", prompts)
        shutdown(llm)

    total = sum(len(p) for p in prompts)
    print(f"hit tokens: cold {cold_hits} of {total}, warm {warm_hits} of {total}")
    same = sum(a == r for a, r in zip(cold, reference)) + sum(b == r for b, r in zip(warm, reference))
    identical = same == 2 * len(prompts)
    print(f"greedy outputs identical to vLLM without the connector: {'yes' if identical else 'NO'} "
          f"({same} of {2 * len(prompts)})")
    if args.disk:
        print(f"disk tier kept at {args.disk}: run again with the same --disk and the cold pass hits too")
    if not identical:
        return 1
    if warm_hits == 0:
        print("the warm pass loaded nothing from kvengine", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

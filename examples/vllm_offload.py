"""kvengine as vLLM's KV cache offload: prompts sharing a long prefix, across engine restarts.

Run it twice. The first run computes the shared prefix once and stores it
(memory, then the disk tier); later requests in the same run load it. The
second run is a fresh vLLM process: its very first request already loads the
prefix from disk.

    .venv-vllm/bin/python examples/vllm_offload.py                    # a tiny random Llama, built locally
    .venv-vllm/bin/python examples/vllm_offload.py --model /path/to/hf/model --disk /var/cache/kv

Needs a vLLM install (``pip install kvengine[vllm]``; on CPU-only machines see
docs/vllm.md for the install notes). On CPU, vLLM wants
``VLLM_CPU_OMP_THREADS_BIND`` / ``VLLM_CPU_KVCACHE_SPACE`` set to taste.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model directory or id (default: a tiny random Llama built here)")
    ap.add_argument("--disk", default=str(Path(tempfile.gettempdir()) / "kvengine-vllm-example"))
    ap.add_argument("--chunk-size", type=lambda v: v if v == "auto" else int(v), default="auto",
                    help="tokens per chunk, or 'auto' (default)")
    ap.add_argument("--requests", type=int, default=4)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model = args.model
    if model is None:
        from kvengine.integrations.vllm.tiny_models import build_model_dir

        model = str(build_model_dir(Path(tempfile.gettempdir()) / "kvengine-tiny-llama", "llama"))
    llm = LLM(model=model, max_model_len=4096, enforce_eager=True, enable_prefix_caching=False,
              kv_transfer_config=kv_transfer_config(args.disk, args.chunk_size))
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)
    system = [rng.randrange(3, vocab) for _ in range(1500)]  # the shared "system prompt"
    params = SamplingParams(max_tokens=16, temperature=0.0)
    for i in range(args.requests):
        question = [rng.randrange(3, vocab) for _ in range(100 + 10 * i)]
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=system + question)], params, use_tqdm=False)[0]
        print(f"request {i}: {len(out.prompt_token_ids)} prompt tokens, {out.num_cached_tokens} loaded from "
              f"kvengine, {time.perf_counter() - t:.2f} s")
    print(f"disk tier: {args.disk} (run again: the first request is a hit too)")


if __name__ == "__main__":
    main()

"""The asyncio API: store a prompt's KV, then reserve and load it for a new request.

Run: .venv/bin/python examples/async_quickstart.py
(`kvengine quickstart` shows the same round trip through the blocking facade.)
"""

from __future__ import annotations

import asyncio

import torch

from kvengine import CacheEngine, ChunkLayout, KVCategory, Namespace, TensorSpec, load_config

CHUNK, LAYERS, HEADS, HEAD_DIM = 64, 2, 2, 32


async def main() -> None:
    layout = ChunkLayout(CHUNK, tuple(
        TensorSpec(name=f"layer{i}", group=0, category=KVCategory.FULL_ATTENTION, dtype=torch.float16,
                   shape=(2, HEADS, CHUNK, HEAD_DIM), token_dim=2)
        for i in range(LAYERS)))
    engine = CacheEngine(load_config({"chunk_size": CHUNK, "memory": {"capacity_bytes": "16MiB"}}))
    await engine.start()
    try:
        model = engine.bind(Namespace(model="example"), layout)
        prompt = list(range(300))
        kv = [torch.randn(2, HEADS, len(prompt), HEAD_DIM, dtype=torch.float16) for _ in range(LAYERS)]
        await engine.store(model, prompt, lambda i, s, e: [t[:, :, s:e] for t in kv])

        follow_up = prompt + [7, 8, 9]  # a later turn shares the whole prompt
        res = await engine.lookup(model, "turn-2", follow_up, max_tokens=len(follow_up) - 1)
        restored = [torch.empty(2, HEADS, res.tokens, HEAD_DIM, dtype=torch.float16) for _ in kv]

        def sink(view):
            s, e = view.token_range
            for dst, src in zip(restored, view.tensors):
                dst[:, :, s:e].copy_(src)

        result = await engine.load(res, sink)
        same = all(torch.equal(r, k[:, :, : result.loaded_tokens]) for r, k in zip(restored, kv))
        print(f"matched {res.tokens} of {len(follow_up)} tokens; loaded {result.loaded_tokens}; "
              f"identical={same}; prefill left: {len(follow_up) - result.loaded_tokens} tokens")
    finally:
        await engine.close()


if __name__ == "__main__":
    asyncio.run(main())

"""Client processes of a host service, run by tests/host/test_service.py as scripts:

    python tests/host/clients.py store SOCKET SEED      an engine stores three chunks, then exits
    python tests/host/clients.py busy SOCKET SECONDS    an engine stores and loads shared and own prompts for
                                                        SECONDS, checking every load; prints the loads
    python tests/host/clients.py killed SOCKET N        N forked clients each pin the stored prefix, half
                                                        write a store of their own, and are SIGKILLed
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from kvengine import KVEngine, Namespace
from kvengine.chunks.keys import ChunkHash, ChunkKey
from kvengine.core.memory_tier import MemoryEntry
from kvengine.host.client import ServiceMemory
from kvengine.types import ModelBinding
from tests.conftest import CHUNK, FakeKV, copier, make_layout

TOKENS = list(range(3 * CHUNK))


def config(socket_path: str) -> dict[str, object]:
    return {"chunk_size": CHUNK, "memory": {"service": socket_path}}


def store(socket_path: str, seed: float) -> int:
    with KVEngine(config(socket_path)) as engine:
        binding = engine.bind(Namespace(model="shared"), make_layout())
        result = engine.store(binding, TOKENS, FakeKV(len(TOKENS), seed=int(seed)).source)
    return 0 if result.stored_chunks == 3 else 1


def busy(socket_path: str, seconds: float) -> int:
    """Prompts of every client's (shared: the same KV under the same tokens) and of this one's own, stored
    and loaded until ``seconds`` pass; exit 1 at the first load that differs from what was stored."""
    with KVEngine(config(socket_path)) as engine:
        binding = engine.bind(Namespace(model="shared"), make_layout())
        own = os.getpid() % 1000 + 1000
        deadline, loads, i = time.monotonic() + seconds, 0, 0
        while time.monotonic() < deadline:
            i += 1
            seed = i % 4 if i % 2 else own + i % 4  # shared prompts 0-3, this client's own
            tokens = [seed, *range(1, 4 * CHUNK)]
            kv = FakeKV(len(tokens), seed=seed)
            engine.store(binding, tokens, kv.source)
            res = engine.lookup(binding, f"r{i}", tokens)
            out = [torch.zeros_like(t) for t in kv.layers]
            n = engine.load(res, copier(out)).loaded_tokens
            if not all(torch.equal(o[:, :, :n], k[:, :, :n]) for o, k in zip(out, kv.layers)):
                print(f"load {i} of prompt {seed} differs", flush=True)
                return 1
            loads += n > 0
    print(loads, flush=True)
    return 0


def killed(socket_path: str, count: float) -> int:
    """Each child holds pins and a half-written store when it dies; the parent reports how many did."""
    binding = ModelBinding.create(Namespace(model="shared"), make_layout())
    died = 0
    for i in range(int(count)):
        pid = os.fork()
        if pid == 0:
            memory = ServiceMemory(socket_path)
            memory.admit(binding)
            memory.pin_prefix(engine_keys(binding))
            slot = memory.prepare(ChunkKey(binding.digest, ChunkHash(i.to_bytes(16, "little"))), binding.layout,
                                  (0, CHUNK))
            if isinstance(slot, MemoryEntry):
                memory.raw(slot)[: slot.nbytes // 2] = 7
            os.kill(os.getpid(), signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        died += os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    print(died, flush=True)
    return 0


def engine_keys(binding: ModelBinding) -> list[ChunkKey]:
    from kvengine.chunks.hashing import prefix_hashes

    return [ChunkKey(binding.digest, h) for h in prefix_hashes(TOKENS, CHUNK, binding.digest)]


if __name__ == "__main__":
    command, path, number = sys.argv[1:4]
    sys.exit({"store": store, "busy": busy, "killed": killed}[command](path, float(number)))

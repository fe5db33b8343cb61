"""Client processes of a host service, run by tests/host/test_service.py as scripts:

    python tests/host/clients.py store SOCKET SEED      an engine stores three chunks, then exits
    python tests/host/clients.py killed SOCKET N        N forked clients each pin the stored prefix, half
                                                        write a store of their own, and are SIGKILLed
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvengine import KVEngine, Namespace
from kvengine.chunks.keys import ChunkHash, ChunkKey
from kvengine.core.memory_tier import MemoryEntry
from kvengine.host.client import ServiceMemory
from kvengine.types import ModelBinding
from tests.conftest import CHUNK, FakeKV, make_layout

TOKENS = list(range(3 * CHUNK))


def config(socket_path: str) -> dict[str, object]:
    return {"chunk_size": CHUNK, "memory": {"service": socket_path}}


def store(socket_path: str, seed: int) -> int:
    with KVEngine(config(socket_path)) as engine:
        binding = engine.bind(Namespace(model="shared"), make_layout())
        result = engine.store(binding, TOKENS, FakeKV(len(TOKENS), seed=seed).source)
    return 0 if result.stored_chunks == 3 else 1


def killed(socket_path: str, count: int) -> int:
    """Each child holds pins and a half-written store when it dies; the parent reports how many did."""
    binding = ModelBinding.create(Namespace(model="shared"), make_layout())
    died = 0
    for i in range(count):
        pid = os.fork()
        if pid == 0:
            memory = ServiceMemory(socket_path)
            memory.admit(binding.digest, binding.layout)
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
    sys.exit(store(path, int(number)) if command == "store" else killed(path, int(number)))

"""Shared fixtures for transport tests: valid chunk records and real tmpfs mounts."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvengine.chunks.keys import ChunkHash, ChunkKey, Namespace, NamespaceDigest
from kvengine.chunks.layout import KVCategory, dtype_code
from kvengine.chunks.record import TensorDescriptor, encode_header
from kvengine.transports.peers.store import MemoryRecordStore

TEST_NAMESPACE = Namespace(model="tests/transports").digest()

MakeRecord = Callable[..., tuple[ChunkKey, bytes]]


def build_record(size: int, *, namespace: NamespaceDigest = TEST_NAMESPACE,
                 payload: bytes | None = None) -> tuple[ChunkKey, bytes]:
    """A fresh key and a valid record (header + ``size`` payload bytes) for it."""
    key = ChunkKey(namespace, ChunkHash(os.urandom(16)))
    data = os.urandom(size) if payload is None else payload
    tensors = (TensorDescriptor(0, KVCategory.OPAQUE, dtype_code(torch.uint8), (len(data),), len(data)),)
    return key, encode_header(key, (0, 16), tensors, codec_id=0, raw_length=len(data), payload=data) + data


class DelayedStore(MemoryRecordStore):
    """A memory store whose gets each wait the next of ``delays`` first (the last one repeats): a slow peer."""

    def __init__(self, capacity: int, *delays: float) -> None:
        super().__init__(capacity)
        self.delays = list(delays)

    async def get(self, keys: Any) -> Any:
        await asyncio.sleep(self.delays.pop(0) if len(self.delays) > 1 else self.delays[0])
        return await super().get(keys)


@pytest.fixture
def make_record() -> MakeRecord:
    """``make_record(size, namespace=..., payload=...) -> (key, record bytes)``.

    The default namespace is ``Namespace(model="tests/transports").digest()``.
    """
    return build_record


class Mounts:
    """Real tmpfs mounts under a test's tmp_path, all unmounted at teardown."""

    def __init__(self, base: Path) -> None:
        self._base = base
        self._mounted: list[Path] = []

    def tmpfs(self, name: str, size: str = "2m") -> Path:
        """Mount a fresh tmpfs of ``size``; skips the test if this process may not mount."""
        target = self._base / name
        target.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(target)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount tmpfs here (needs root/CAP_SYS_ADMIN): {done.stderr.strip()}")
        self._mounted.append(target)
        return target

    def remount_read_only(self, target: Path) -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(target)], check=True, capture_output=True)

    def unmount_all(self) -> None:
        for target in reversed(self._mounted):
            if subprocess.run(["umount", str(target)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(target)], capture_output=True)
        self._mounted.clear()


@pytest.fixture
def mounts(tmp_path: Path) -> Iterator[Mounts]:
    m = Mounts(tmp_path)
    try:
        yield m
    finally:
        m.unmount_all()

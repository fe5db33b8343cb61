"""Shared fixtures: tiny layouts and engines built locally."""

from __future__ import annotations

import os

import pytest
import torch

from kvengine import ChunkLayout, EngineConfig, KVCategory, Namespace, TensorSpec, load_config

CHUNK = 16

# KVENGINE_* variables of the machine running the suite would override every engine the tests build
# (and those of the vLLM/SGLang subprocesses, which inherit the environment): the suite sets its own.
for _name in [n for n in os.environ if n.startswith("KVENGINE_")]:
    del os.environ[_name]


def make_layout(chunk: int = CHUNK, layers: int = 2, heads: int = 2, dim: int = 4,
                dtype: torch.dtype = torch.float32) -> ChunkLayout:
    return ChunkLayout(chunk, tuple(
        TensorSpec(name=f"layer{i}", group=0, category=KVCategory.FULL_ATTENTION, dtype=dtype,
                   shape=(2, heads, chunk, dim), token_dim=2)
        for i in range(layers)
    ))


def make_config(capacity: int = 1 << 20, **extra: object) -> EngineConfig:
    return load_config({"chunk_size": CHUNK, "memory": {"capacity_bytes": capacity}, **extra}, environ={})


class FakeKV:
    """Per-layer KV of one request, shaped like ``make_layout``'s tensors."""

    def __init__(self, tokens: int, layers: int = 2, heads: int = 2, dim: int = 4, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.layers = [torch.randn(2, heads, tokens, dim, generator=g) for _ in range(layers)]

    def source(self, index: int, start: int, end: int) -> list[torch.Tensor]:
        return [t[:, :, start:end] for t in self.layers]


def copier(out: list[torch.Tensor]):
    """A load sink that copies each chunk into ``out`` (tensors shaped like ``FakeKV.layers``)."""
    def sink(view) -> None:
        s, e = view.token_range
        for dst, src in zip(out, view.tensors):
            dst[:, :, s:e].copy_(src)
    return sink


@pytest.fixture
def layout() -> ChunkLayout:
    return make_layout()


@pytest.fixture
def namespace() -> Namespace:
    return Namespace(model="tiny-test")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A test that fails between starting a ZeroMQ server and closing it leaves its context to the garbage
    collector, and pyzmq's teardown of a context whose socket still has a receive pending on a closed event
    loop blocks forever: pytest's last collection (after the summary) would hang the run instead of ending it
    with the failure. Tell pyzmq the process is exiting, as its own atexit hook does, so leftover contexts are
    left to the exit."""
    try:
        import zmq.sugar.context as zmq_context
    except ImportError:
        return
    zmq_context._exiting = True

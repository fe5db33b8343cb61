"""The Hugging Face integration on a ``kvengine host`` service: a fresh engine continues, exactly, from what
another engine stored in the service's memory (attention KV, and a hybrid's linear-attention state)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from kvengine import KVEngine
from kvengine.config import MemoryConfig
from kvengine.host.service import HostService
from kvengine.integrations.hf import attach

from .conftest import CHUNK, build_tiny, prompt_for, reference_generate

PREFIX = 3 * CHUNK


@pytest.fixture
def service(tmp_path: Path) -> Iterator[HostService]:
    s = HostService(MemoryConfig(capacity_bytes="64MiB"), tmp_path / "s.sock")
    s.start()
    yield s
    s.close()


@pytest.mark.parametrize("family", ["llama", "falcon_h1"])
def test_a_fresh_engine_continues_exactly_from_what_another_stored_in_the_service(service, family):
    model = build_tiny(family)
    ids, _ = prompt_for(model, PREFIX + 5, seed=7)
    want = reference_generate(model, ids, None, 12)
    config = {"chunk_size": CHUNK, "memory": {"service": str(service.path)}}
    with KVEngine(config) as first:
        miss = attach(model, first).generate(ids, max_new_tokens=12, eos_token_id=None)
    with KVEngine(config) as fresh:
        hit = attach(model, fresh).generate(ids, max_new_tokens=12, eos_token_id=None)
    assert (miss.reused_tokens, hit.reused_tokens) == (0, PREFIX)
    assert list(miss.new_tokens) == list(hit.new_tokens) == want
    deadline = time.monotonic() + 5  # the closed engines' last releases may still be in flight
    while service.stats().pins and time.monotonic() < deadline:
        time.sleep(0.05)
    assert service.stats().pins == 0

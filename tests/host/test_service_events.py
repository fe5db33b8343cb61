"""KV events of the host service's arena (``kvengine host --config`` with an events section): engines on the
service send each stored chunk's event, the service publishes it, and its evictions, as an engine would."""

from __future__ import annotations

import zmq

from kvengine import KVEngine, Namespace
from kvengine.chunks.hashing import prefix_hashes
from kvengine.config import EventsConfig, MemoryConfig
from kvengine.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventPublisher
from kvengine.host.service import HostService

from ..conftest import CHUNK, FakeKV, make_layout
from ..test_events import Subscriber, chunks_of, expected_chunks, tokens_of
from .clients import config

LAYOUT = make_layout()


def test_the_service_publishes_what_engines_store_and_what_it_evicts(tmp_path):
    """An engine on a service with events stores a prompt: its chunks are published chained with their tokens,
    medium CPU, as an in-process engine publishes them. A second prompt overflows the arena: the chunks the
    service evicts are published removed, each after its store. The service closing clears all."""
    ctx = zmq.Context()
    sub = Subscriber(ctx)
    events = KVEventPublisher.from_config(EventsConfig(endpoint=sub.endpoint))
    assert events is not None
    service = HostService(MemoryConfig(capacity_bytes=4 * LAYOUT.nbytes(), slab_bytes=LAYOUT.nbytes()),
                          tmp_path / "kvengine.sock", events=events)
    service.start()
    try:
        sub.sync(events)
        with KVEngine(config(str(tmp_path / "kvengine.sock"))) as engine:
            assert engine._core.memory.publishes_events
            binding = engine.bind(Namespace(model="tiny"), LAYOUT)
            first, second = tokens_of(3 * CHUNK, 1), tokens_of(3 * CHUNK, 2)
            assert engine.store(binding, first, FakeKV(len(first)).source).stored_chunks == 3
            sub.wait_for(lambda: len(chunks_of(sub.events(BlockStored))) == 3)
            assert chunks_of(sub.events(BlockStored)) == expected_chunks(binding, first)
            assert engine.store(binding, second, FakeKV(len(second)).source).stored_chunks == 3  # room for 4
            sub.wait_for(lambda: len(chunks_of(sub.events(BlockStored))) == 6
                         and sum(len(e.block_hashes) for e in sub.events(BlockRemoved)) == 2)
            assert chunks_of(sub.events(BlockStored))[3:] == expected_chunks(binding, second)
            removed = [h for e in sub.events(BlockRemoved) for h in e.block_hashes]
            assert set(removed) <= set(prefix_hashes(first, CHUNK, binding.digest))
            order = [(type(e), h) for e in sub.events() for h in getattr(e, "block_hashes", ())]
            assert all(order.index((BlockStored, h)) < order.index((BlockRemoved, h)) for h in removed)
    finally:
        service.close()
    sub.wait_for(lambda: isinstance(sub.messages[-1].batch.events[-1], AllBlocksCleared))
    ctx.destroy(linger=0)

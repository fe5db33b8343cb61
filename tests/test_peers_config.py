"""Peer sharing selected by configuration alone: two engines, one peer server, real sockets."""

from __future__ import annotations

import pytest
import torch

from kvengine import ConfigError, KVEngine, Namespace, load_config
from kvengine.tiers import build_transports
from kvengine.transports.peer_service import ServerThread
from kvengine.transports.peer_store import MemoryRecordStore
from kvengine.transports.zmq_peer import ZmqPeerServer

from .conftest import CHUNK, FakeKV, copier, make_layout


def test_engines_share_chunks_through_a_configured_peer():
    """Engine A writes behind to the peer named in its config; engine B, configured alike, hits."""
    layout = make_layout()
    server = ServerThread(ZmqPeerServer(MemoryRecordStore(64 << 20), "127.0.0.1:0"))
    address = server.start()
    cfg = {"chunk_size": CHUNK, "memory": {"capacity_bytes": 8 * layout.nbytes()},
           "peers": {"peers": [address], "replicas": 1}}
    kv = FakeKV(2 * CHUNK, seed=11)
    toks = list(range(2 * CHUNK))
    try:
        with KVEngine(cfg) as a:
            assert [t.name for t in a.core.transports] == ["peers_zmq"]
            a.store(a.bind(Namespace(model="m"), layout), toks, kv.source)
        with KVEngine(cfg) as b:
            binding = b.bind(Namespace(model="m"), layout)
            res = b.lookup(binding, "r", toks)
            out = [torch.zeros_like(t) for t in kv.layers]
            result = b.load(res, copier(out))
            assert res.matched_tokens == 2 * CHUNK and result.ok
            assert all(torch.equal(o, k) for o, k in zip(out, kv.layers))
            assert b.metrics.value("kvengine_loaded_bytes_total", tier="peers_zmq") == 2 * layout.nbytes()
    finally:
        server.stop()


def test_ucx_refuses_curve_keys():
    with pytest.raises(ConfigError, match="ZeroMQ-only"):
        load_config({"peers": {"transport": "ucx", "peers": ["127.0.0.1:1"], "curve_public_key": "x"}},
                    environ={})


def test_no_peers_no_peer_tier():
    assert build_transports(load_config(environ={})) == []

"""Peer sharing selected by configuration alone: two engines, one peer server, real sockets."""

from __future__ import annotations

import pytest
import torch

from kvengine import ConfigError, InvalidRequestError, KVEngine, Namespace, load_config
from kvengine.chunks.record import decode_header
from kvengine.sharing import EngineStore
from kvengine.tiers import build_tiers
from kvengine.transports.peers.service import ServerThread
from kvengine.transports.peers.store import MemoryRecordStore
from kvengine.transports.peers.tcp import TcpPeerServer
from kvengine.transports.peers.zmq import ZmqPeerServer
from tests.conftest import CHUNK, FakeKV, copier, make_layout


def test_engines_share_chunks_through_a_configured_peer():
    """Engine A writes behind to the peer named in its config; engine B, configured alike, hits. The
    default wire is tcp, as for ``kvengine serve``: a default engine reaches a default server."""
    layout = make_layout()
    server = ServerThread(TcpPeerServer(MemoryRecordStore(64 << 20), "127.0.0.1:0"))
    address = server.start()
    cfg = {"chunk_size": CHUNK, "memory": {"capacity_bytes": 8 * layout.nbytes()},
           "peers": {"peers": [address], "replicas": 1}}
    kv = FakeKV(2 * CHUNK, seed=11)
    toks = list(range(2 * CHUNK))
    try:
        with KVEngine(cfg) as a:
            assert [t.name for t in a._core.transports] == ["peers_tcp"]
            a.store(a.bind(Namespace(model="m"), layout), toks, kv.source)
        with KVEngine(cfg) as b:
            binding = b.bind(Namespace(model="m"), layout)
            res = b.lookup(binding, "r", toks)
            out = [torch.zeros_like(t) for t in kv.layers]
            result = b.load(res, copier(out))
            assert res.tokens == 2 * CHUNK and result.ok
            assert all(torch.equal(o, k) for o, k in zip(out, kv.layers))
            assert b.metrics.value("kvengine_loaded_bytes_total", tier="peers_tcp") == 2 * layout.nbytes()
    finally:
        server.stop()


def test_ucx_refuses_curve_keys():
    """CURVE keys with the UCX transport are refused as ZeroMQ-only."""
    with pytest.raises(ConfigError, match="ZeroMQ-only"):
        load_config({"peers": {"transport": "ucx", "peers": ["127.0.0.1:1"], "curve_public_key": "x"}},
                    environ={})


def test_no_peers_no_peer_tier():
    """A default config (no disk, no peers) builds no lower tier."""
    assert build_tiers(load_config(environ={})) == []


def test_each_tier_writes_with_its_own_codec(tmp_path):
    """disk.codec and peers.codec are chosen apart: compressed on disk, raw to the peer, both exact."""
    layout = make_layout(dtype=torch.bfloat16)
    backing = MemoryRecordStore(64 << 20)
    server = ServerThread(ZmqPeerServer(backing, "127.0.0.1:0"))
    address = server.start()
    kv = FakeKV(2 * CHUNK, seed=5)
    kv.layers = [t.to(torch.bfloat16) for t in kv.layers]
    toks = list(range(2 * CHUNK))
    base = {"chunk_size": CHUNK, "memory": {"capacity_bytes": 8 * layout.nbytes()}, "write_mode": "write_through"}
    try:
        with KVEngine({**base, "disk": {"path": str(tmp_path), "codec": "zstd-byteshuffle"},
                       "peers": {"transport": "zmq", "peers": [address], "replicas": 1, "codec": "raw"}}) as a:
            a.store(a.bind(Namespace(model="m"), layout), toks, kv.source)
        disk_codecs = {decode_header(f.read_bytes()).codec_id for f in tmp_path.rglob("*.kvc")}
        peer_codecs = {decode_header(bytes(r)).codec_id for r in backing._records.values()}
        assert disk_codecs == {3} and peer_codecs == {0}  # zstd-byteshuffle, raw
        for tier in ({"disk": {"path": str(tmp_path)}}, {"peers": {"transport": "zmq", "peers": [address], "replicas": 1}}):
            with KVEngine({**base, **tier}) as b:
                binding = b.bind(Namespace(model="m"), layout)
                out = [torch.zeros_like(t) for t in kv.layers]
                result = b.load(b.lookup(binding, "r", toks), copier(out))
                assert result.loaded_tokens == 2 * CHUNK and all(torch.equal(o, k) for o, k in zip(out, kv.layers))
    finally:
        server.stop()


def test_tier_codecs_of_different_families_are_refused(tmp_path):
    """One namespace is served by every tier, so a lossy disk next to an exact peer tier cannot start."""
    cfg = {"disk": {"path": str(tmp_path), "codec": "int8-token"}, "peers": {"peers": ["127.0.0.1:1"]}}
    with pytest.raises(ConfigError, match="different KV"):
        KVEngine(cfg)


def test_unknown_peer_codec_names_the_setting():
    """An unknown peer codec is refused, naming peers.codec."""
    with pytest.raises(ConfigError, match="peers.codec"):
        KVEngine({"peers": {"peers": ["127.0.0.1:1"], "codec": "zip"}})


def test_engine_store_refuses_to_serve_another_codec_family():
    """A node whose peers.codec is lossy never serves its memory to exact readers."""
    layout = make_layout()
    with KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": 8 * layout.nbytes()},
                   "peers": {"codec": "int8-token"}}, transports=[]) as eng:
        store = EngineStore(eng._core, MemoryRecordStore(1 << 20))
        with pytest.raises(InvalidRequestError, match="int8-token"):
            store.share(eng.bind(Namespace(model="m"), layout))
        store.share(eng.bind(Namespace(model="m", codec_family="lossy:int8-token"), layout))

"""kvengine.sharing: a wire's name to its server (with that wire's security only), and an engine's memory tier
served to a real peer client."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvengine.chunks.keys import Namespace
from kvengine.chunks.layout import ChunkLayout, KVCategory, TensorSpec
from kvengine.errors import ConfigError
from kvengine.facade import KVEngine
from kvengine.sharing import EngineServer, WireOptions, peer_server
from kvengine.transports.peers.service import ServerOptions
from kvengine.transports.peers.store import MemoryRecordStore

CHUNK = 4
LAYOUT = ChunkLayout(CHUNK, (TensorSpec(name="k", group=0, category=KVCategory.FULL_ATTENTION, shape=(CHUNK, 8),
                                        dtype=torch.float32),))


@pytest.mark.parametrize("wire, message", [
    (WireOptions(transport="zmq", tls_cert=Path("c.pem")), "--bind: TLS and message_timeout are settings of the tcp "
                                                           "wire, not zmq"),
    (WireOptions(transport="ucx", message_timeout=3.0), "TLS and message_timeout are settings of the tcp wire"),
    (WireOptions(transport="tcp", curve_secret_key=b"s" * 40), "--bind: CURVE is a setting of the zmq wire, not tcp"),
    (WireOptions(transport="tcp", tls_ca=Path("ca.pem")), "a TLS key or CA needs the server's certificate"),
    (WireOptions(transport="zmq", curve_secret_key=b"s" * 40), "CURVE needs the server's public key"),
])
def test_a_wire_takes_its_own_security_settings_only(wire, message):
    with pytest.raises(ConfigError, match=message):
        peer_server(MemoryRecordStore(1 << 20), "127.0.0.1:0", ServerOptions(), wire, what="--bind")


@pytest.mark.parametrize("transport", ["tcp", "zmq"])
def test_off_loopback_a_server_needs_a_secret_or_an_encrypted_wire(transport):
    with pytest.raises(ConfigError, match="handoff.listen 10.1.2.3:0 is not on loopback"):
        peer_server(MemoryRecordStore(1 << 20), "10.1.2.3:0", ServerOptions(), WireOptions(transport=transport),
                    what="handoff.listen")


def test_an_engine_server_serves_its_memory_tier_to_a_peer_client():
    """An engine's chunk, shared through EngineServer, is read by a second engine whose peer tier dials it."""
    tokens = np.arange(7, 7 + CHUNK, dtype="<u4")
    namespace = Namespace(model="sharing")
    with KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": "1MiB"}}, transports=[]) as owner:
        binding = owner.bind(namespace, LAYOUT)
        value = torch.arange(CHUNK * 8, dtype=torch.float32).reshape(CHUNK, 8)
        assert owner.store(binding, tokens, lambda _i, _start, _end: [value]).stored_chunks == 1
        server = EngineServer(owner, "127.0.0.1:0", WireOptions(), secret=None, what="test")
        address = server.start()
        try:
            with KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": "1MiB"},
                           "peers": {"peers": [address], "replicas": 1}}) as reader:
                theirs = reader.bind(namespace, LAYOUT)
                assert reader.lookup(theirs, "r", tokens).matched_tokens == 0  # not shared yet
                server.share(binding)
                res = reader.lookup(theirs, "r2", tokens)
                assert res.matched_tokens == CHUNK
                got: list[torch.Tensor] = []
                reader.load(res, lambda view: got.append(view.tensors[0].clone()))
                assert torch.equal(got[0], value)
        finally:
            server.stop()

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
from kvengine.sharing import EngineServer, WireOptions, WireSettingNames, peer_server
from kvengine.transports.peers.service import ServerOptions
from kvengine.transports.peers.store import MemoryRecordStore

CHUNK = 4
LAYOUT = ChunkLayout(CHUNK, (TensorSpec(name="k", group=0, category=KVCategory.FULL_ATTENTION, shape=(CHUNK, 8),
                                        dtype=torch.float32),))


#: Settings as a command's flags name them (what ``kvengine serve`` passes).
FLAGS = WireSettingNames(bind="--bind", transport="--transport", secret="--secret-file",
                         tls="--tls-cert/--tls-key/--tls-ca", curve_keys="--curve-cert", curve_allow="--curve-allow")
#: The same settings as a config file names them.
KEYS = WireSettingNames(bind="x.listen", transport="x.transport", secret="x.secret_file", tls="x.tls_*",
                        curve_keys="x.curve_keys", curve_allow="x.curve_allow")


@pytest.mark.parametrize("wire, says", [
    (WireOptions(transport="zmq", tls_cert=Path("c.pem")), "{tls} are settings of the tcp wire; {transport} is 'zmq'"),
    (WireOptions(transport="ucx", message_timeout=3.0), "a message timeout is a setting of the tcp wire; {transport} "
                                                        "is 'ucx'"),
    (WireOptions(transport="tcp", curve_secret_key=b"s" * 40), "{curve_keys} and {curve_allow} are settings of the "
                                                               "zmq wire; {transport} is 'tcp'"),
    (WireOptions(transport="tcp", tls_ca=Path("ca.pem")), "{tls}: a TLS key or CA needs the server's certificate"),
    (WireOptions(transport="zmq", curve_secret_key=b"s" * 40), "{curve_keys}: CURVE needs the server's public key"),
])
@pytest.mark.parametrize("names", [FLAGS, KEYS])
def test_a_wire_takes_its_own_security_settings_only_and_says_so_in_the_callers_words(wire, says, names):
    with pytest.raises(ConfigError) as refused:
        peer_server(MemoryRecordStore(1 << 20), "127.0.0.1:0", ServerOptions(), wire, names=names)
    assert str(refused.value).startswith(says.format(**{f: getattr(names, f) for f in names.__slots__}))


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
@pytest.mark.parametrize("names", [FLAGS, KEYS])
def test_off_loopback_a_server_needs_a_secret_or_an_encrypted_wire_named_as_the_caller_names_them(transport, names):
    with pytest.raises(ConfigError) as refused:
        peer_server(MemoryRecordStore(1 << 20), "10.1.2.3:0", ServerOptions(), WireOptions(transport=transport),
                    names=names)
    message = str(refused.value)
    assert message.startswith(f"{names.bind} 10.1.2.3:0 is not on loopback")
    assert f"Set {names.secret}" in message and names.tls in message and names.curve_keys in message
    assert "peers." not in message  # not another caller's settings


def test_off_loopback_a_zmq_server_must_list_its_clients_even_with_a_secret():
    """libzmq buffers a message whole before kvengine checks it: a secret does not protect a zmq server."""
    with pytest.raises(ConfigError, match="--bind 10.1.2.3:0 is off loopback: on the zmq wire a server admits only "
                                          "listed clients \\(--curve-allow, with --curve-cert\\)"):
        peer_server(MemoryRecordStore(1 << 20), "10.1.2.3:0", ServerOptions(secret=b"s" * 32),
                    WireOptions(transport="zmq"), names=FLAGS)


def test_an_engine_server_serves_its_memory_tier_to_a_peer_client():
    """An engine's chunk, shared through EngineServer, is read by a second engine whose peer tier dials it."""
    tokens = np.arange(7, 7 + CHUNK, dtype="<u4")
    namespace = Namespace(model="sharing")
    with KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": "1MiB"}}, transports=[]) as owner:
        binding = owner.bind(namespace, LAYOUT)
        value = torch.arange(CHUNK * 8, dtype=torch.float32).reshape(CHUNK, 8)
        assert owner.store(binding, tokens, lambda _i, _start, _end: [value]).stored_chunks == 1
        server = EngineServer(owner, "127.0.0.1:0", WireOptions(), secret=None, names=KEYS)
        address = server.start()
        try:
            with KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": "1MiB"},
                           "peers": {"peers": [address], "replicas": 1}}) as reader:
                theirs = reader.bind(namespace, LAYOUT)
                assert reader.lookup(theirs, "r", tokens).tokens == 0  # not shared yet
                server.share(binding)
                res = reader.lookup(theirs, "r2", tokens)
                assert res.tokens == CHUNK
                got: list[torch.Tensor] = []
                reader.load(res, lambda view: got.append(view.tensors[0].clone()))
                assert torch.equal(got[0], value)
        finally:
            server.stop()

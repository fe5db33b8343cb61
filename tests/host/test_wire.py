"""The host service's control frames: layouts and keys round-trip, and malformed ones are refused."""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch

from kvengine.chunks.keys import ChunkHash, ChunkKey, Namespace, NamespaceDigest
from kvengine.chunks.layout import ChunkLayout, KVCategory, TensorSpec
from kvengine.events import MEDIUM_MEMORY, BlockStored
from kvengine.host import wire
from kvengine.host.wire import WireError

from ..conftest import make_layout


def test_a_layout_crosses_the_wire_with_its_fingerprint():
    mixed = ChunkLayout(16, (
        TensorSpec(name="k", group=0, category=KVCategory.FULL_ATTENTION, dtype=torch.float32, shape=(2, 16, 4)),
        TensorSpec(name="state", group=1, category=KVCategory.LINEAR_STATE, dtype=torch.bfloat16, shape=(3, 5),
                   token_dim=None),
    ))
    for layout in (make_layout(), mixed):
        back = wire.layout_from_json(wire.layout_json(layout))
        assert back == layout and back.fingerprint == layout.fingerprint


@pytest.mark.parametrize("raw", [b"", b"[16]", b'[16, [["k", 0, 1, 99, [2, 16], 0]]]',
                                 b'[16, [["k", 0, 42, 8, [2, 16], 0]]]', b'[0, [["k", 0, 1, 8, [2, 16], 0]]]',
                                 b'[16, [["k", 0, 1, 8, [-2, 16], 0]]]'])
def test_a_malformed_layout_is_a_wire_error(raw):
    with pytest.raises(WireError, match="not a chunk layout"):
        wire.layout_from_json(raw)


def test_a_namespace_crosses_the_wire_and_a_malformed_one_is_a_wire_error():
    namespace = Namespace(model="m", rank=1, world_size=2, cache_salt="s", extra_keys=("a", "b"))
    assert wire.namespace_from_json(wire.namespace_json(namespace)) == namespace
    for raw in (b"", b"[]", b'{"model": ""}', b'{"model": "m", "rank": 3}', b'{"model": "m", "nope": 1}'):
        with pytest.raises(WireError, match="not a namespace"):
            wire.namespace_from_json(raw)


def test_a_frame_shorter_than_its_head_is_a_wire_error():
    head = wire.PROMOTE.pack(b"d" * 16, 1, 2)
    assert wire.unpack_head(wire.PROMOTE, head + b"rest") == ((b"d" * 16, 1, 2), b"rest")
    with pytest.raises(WireError, match="at least"):
        wire.unpack_head(wire.PROMOTE, head[:-1])


def test_stored_chunks_events_cross_the_wire_and_a_malformed_frame_is_refused():
    keys = [ChunkKey(NamespaceDigest(b"n" * 16), ChunkHash(bytes([i]) * 16)) for i in range(2)]
    tokens = np.arange(8, dtype="<u4").tobytes()
    events = [BlockStored((keys[0].chunk_hash,), None, tokens, 8, MEDIUM_MEMORY),
              BlockStored((keys[1].chunk_hash,), keys[0].chunk_hash, tokens[:16], 8, MEDIUM_MEMORY, "lora-a")]
    packed = wire.pack_stored(list(zip(keys, events)))
    assert wire.unpack_stored(packed) == list(zip(keys, events))
    for bad in (packed[:-1], packed + b"x", packed[:4] + packed[4:40]):
        with pytest.raises(WireError):
            wire.unpack_stored(bad)


def test_keys_round_trip_and_a_short_list_is_refused():
    keys = [ChunkKey(NamespaceDigest(bytes([i]) * 16), ChunkHash(bytes([i + 1]) * 16)) for i in range(3)]
    packed = wire.pack_keys(keys)
    assert wire.unpack_keys(packed) == keys
    with pytest.raises(WireError, match="3 keys need"):
        wire.unpack_keys(packed[:-1])
    with pytest.raises(WireError):
        wire.unpack_keys(b"\x01")


def test_frames_round_trip_with_a_descriptor_however_they_arrive_and_oversized_ones_are_refused():
    a, b = socket.socketpair()
    with a, b:
        r, w = socket.socketpair()
        with r, w:
            wire.send_frame(a, wire.Status.OK, b"payload", [w.fileno()])
            reader = wire.FrameReader(b)
            code, payload, fds = reader.read(max_fds=1)
            assert (code, payload, len(fds)) == (wire.Status.OK, b"payload", 1)
            socket.socket(fileno=fds[0]).close()
        wire.send_frame(a, wire.Op.UNPIN, b"one")
        wire.send_frame(a, wire.Op.STATS, b"two")
        a.sendall(b"\x06\x00")  # the start of a third
        assert reader.read()[1:] == (b"one", []) and reader.read()[1:] == (b"two", [])
        a.sendall(b"\x00\x00\x0athree")
        assert reader.read() == (wire.Op.STATS, b"three", [])
        a.sendall((wire.MAX_FRAME + 1).to_bytes(4, "little") + b"\x01")
        with pytest.raises(WireError, match="frame length"):
            wire.FrameReader(b).read()
        a.close()
        with pytest.raises(WireError, match="closed"):
            wire.FrameReader(b).read()

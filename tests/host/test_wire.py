"""The host service's control frames: layouts and keys round-trip, and malformed ones are refused."""

from __future__ import annotations

import socket

import pytest
import torch

from kvengine.chunks.keys import ChunkHash, ChunkKey, NamespaceDigest
from kvengine.chunks.layout import ChunkLayout, KVCategory, TensorSpec
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

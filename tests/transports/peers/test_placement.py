"""Placement of chunks on peers: rendezvous hashing, membership files, cool-downs."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from kvengine.chunks.keys import ChunkHash, ChunkKey, Namespace
from kvengine.errors import ConfigError
from kvengine.transports.peers.placement import Membership, Peer, PeerHealth, parse_peer_list, rendezvous_owners

NS = Namespace(model="tests/placement").digest()
PEERS = [Peer(f"127.0.0.{i}", 7000 + i) for i in range(2, 8)]


def keys(n: int, seed: int = 0) -> list[ChunkKey]:
    return [ChunkKey(NS, ChunkHash(i.to_bytes(8, "little") + seed.to_bytes(8, "little"))) for i in range(n)]


def test_owners_are_distinct_ranked_and_stable_under_reordering() -> None:
    """The same key gets the same owners whatever order the peer list is in."""
    for key in keys(50):
        owners = rendezvous_owners(key, PEERS, 3)
        assert len(set(owners)) == 3
        assert rendezvous_owners(key, list(reversed(PEERS)), 3) == owners
        assert rendezvous_owners(key, PEERS, 1) == owners[:1]


def test_owners_are_stable_across_processes() -> None:
    """Scenario: two nodes compute owners independently; they must agree (xxhash, no PYTHONHASHSEED)."""
    key = keys(1)[0]
    code = (
        "from kvengine.transports.peers.placement import Peer, rendezvous_owners\n"
        "from kvengine.chunks.keys import ChunkKey\n"
        f"k = ChunkKey.from_hex({key.hex()!r})\n"
        f"peers = [Peer('127.0.0.{{}}'.format(i), 7000 + i) for i in range(2, 8)]\n"
        "print(','.join(p.address for p in rendezvous_owners(k, peers, 2)))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == ",".join(p.address for p in rendezvous_owners(key, PEERS, 2))


def test_load_spreads_evenly() -> None:
    """Owners of many keys spread over every peer, none more than 25% above an even share."""
    counts = Counter(rendezvous_owners(k, PEERS, 1)[0] for k in keys(6000))
    assert set(counts) == set(PEERS)
    assert max(counts.values()) < 1.25 * 6000 / len(PEERS)


def test_removing_a_peer_moves_only_its_keys() -> None:
    """Rendezvous property: keys not owned by the removed peer keep their owner (membership change = few misses)."""
    gone = PEERS[0]
    rest = PEERS[1:]
    moved = 0
    for key in keys(3000):
        before = rendezvous_owners(key, PEERS, 1)[0]
        after = rendezvous_owners(key, rest, 1)[0]
        if before != gone:
            assert after == before
        else:
            moved += 1
    assert 0 < moved < 3000 / len(PEERS) * 1.3


def test_replicas_beyond_the_peer_count_give_every_peer() -> None:
    """Asking more replicas than peers gives every peer; no peers give none; zero replicas is a ConfigError."""
    assert sorted(rendezvous_owners(keys(1)[0], PEERS[:2], 5)) == sorted(PEERS[:2])
    assert rendezvous_owners(keys(1)[0], [], 2) == []
    with pytest.raises(ConfigError):
        rendezvous_owners(keys(1)[0], PEERS, 0)


@pytest.mark.parametrize("text, expected", [
    ("127.0.0.2:7000", Peer("127.0.0.2", 7000)),
    ("tcp://10.0.0.1:1", Peer("10.0.0.1", 1)),
    ("[::1]:9000", Peer("::1", 9000)),
])
def test_peer_addresses_parse(text: str, expected: Peer) -> None:
    """host:port, tcp:// and bracketed IPv6 addresses parse, and a peer's address parses back to it."""
    assert Peer.parse(text) == expected
    assert Peer.parse(expected.address) == expected


@pytest.mark.parametrize("text", ["localhost", "host:", ":80", "h:0", "h:70000", "h:x"])
def test_bad_peer_addresses_raise(text: str) -> None:
    """An address without a valid host and port (1-65535) is a ConfigError."""
    with pytest.raises(ConfigError):
        Peer.parse(text)


def test_peer_list_ignores_comments_blanks_and_duplicates() -> None:
    """A peer list drops comments, blank lines and duplicates, keeping order."""
    peers = parse_peer_list(["# nodes", "", "127.0.0.2:1  # a", "127.0.0.2:1", "127.0.0.3:1"])
    assert peers == (Peer("127.0.0.2", 1), Peer("127.0.0.3", 1))


def test_membership_file_is_reloaded_when_it_changes(tmp_path: Path) -> None:
    """Scenario: a node is added to the peer file at runtime; the next check after the interval sees it."""
    now = [0.0]
    path = tmp_path / "peers"
    path.write_text("127.0.0.2:1\n")
    members = Membership(path=path, reload_interval=1.0, clock=lambda: now[0])
    assert members.peers() == (Peer("127.0.0.2", 1),)
    path.write_text("127.0.0.2:1\n127.0.0.3:1\n")
    os.utime(path, ns=(path.stat().st_mtime_ns + 10**9,) * 2)
    assert len(members.peers()) == 1  # not re-checked before the interval
    now[0] = 1.5
    assert members.peers() == (Peer("127.0.0.2", 1), Peer("127.0.0.3", 1))
    assert members.version == 1


def test_membership_sees_a_replaced_file_of_the_same_size_and_mtime(tmp_path: Path) -> None:
    """Scenario: the list is swapped by rename for one of equal length within one mtime tick; it is re-read."""
    now = [0.0]
    path = tmp_path / "peers"
    path.write_text("127.0.0.2:1\n")
    members = Membership(path=path, reload_interval=0.1, clock=lambda: now[0])
    stamp = path.stat().st_mtime_ns
    tmp = tmp_path / "peers.tmp"
    tmp.write_text("127.0.0.3:1\n")
    os.utime(tmp, ns=(stamp, stamp))
    os.replace(tmp, path)
    now[0] = 1.0
    assert members.peers() == (Peer("127.0.0.3", 1),)


def test_membership_keeps_last_good_list_when_the_file_breaks(tmp_path: Path) -> None:
    """A peers file that becomes invalid or disappears leaves the last good list in use."""
    now = [0.0]
    path = tmp_path / "peers"
    path.write_text("127.0.0.2:1\n")
    members = Membership(path=path, reload_interval=0.1, clock=lambda: now[0])
    path.write_text("not an address\n")
    now[0] = 1.0
    assert members.peers() == (Peer("127.0.0.2", 1),)
    path.unlink()
    now[0] = 2.0
    assert members.peers() == (Peer("127.0.0.2", 1),)


def test_membership_file_must_exist_at_start(tmp_path: Path) -> None:
    """A peers file missing at start is a ConfigError."""
    with pytest.raises(ConfigError):
        Membership(path=tmp_path / "missing")


def test_static_and_file_peers_are_merged(tmp_path: Path) -> None:
    """Static peers and those of the peers file are merged."""
    path = tmp_path / "peers"
    path.write_text("127.0.0.3:1\n")
    assert Membership(["127.0.0.2:1"], path=path).peers() == (Peer("127.0.0.2", 1), Peer("127.0.0.3", 1))


def test_failed_peer_is_skipped_for_the_cooldown_then_probed() -> None:
    """A failed peer is unusable for the cooldown, then tried once more; another failure downs it, a success
    restores it."""
    now = [0.0]
    health = PeerHealth(5.0, clock=lambda: now[0])
    peer = PEERS[0]
    assert health.usable(peer)
    health.failed(peer)
    assert not health.usable(peer) and health.down() == [peer]
    now[0] = 4.9
    assert not health.usable(peer)
    now[0] = 5.0
    assert health.usable(peer)  # half-open: one more try
    health.failed(peer)
    assert not health.usable(peer)
    health.succeeded(peer)
    assert health.usable(peer)

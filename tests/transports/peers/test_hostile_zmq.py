"""The hostile-peer suite (issue 18): each attack of :mod:`tests.transports.peers.hostile` on real sockets.

Every attack must serve no wrong byte, keep (or, after a flood, promptly resume) serving the honest
victim exactly, and keep the server's memory flat. benchmarks/bench_hostile_peers.py runs the same
attacks and prints the table in docs/security.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.transports.peers import hostile

pytestmark = pytest.mark.slow

#: Server RSS growth allowed per attack: noise of a Python process, far below what the attacks send.
RSS_SLACK_MIB = 16.0


def check(outcome: hostile.Outcome, *, all_detected: bool = True) -> None:
    assert outcome.served_wrong == 0, outcome
    assert outcome.valid_served, outcome
    assert outcome.rss_growth_mib < RSS_SLACK_MIB, outcome
    if all_detected:
        assert outcome.detected == outcome.attempts, outcome


async def test_forged_records_from_a_client_without_the_secret_are_refused_and_never_served() -> None:
    """Regression: an unauthenticated server took DELETE + PUT of well-formed forgeries, and a forgery planted
    before the victim's own store won. With a secret, every forged put is refused, every delete of a valid
    record is refused, and the victim reads its own bytes."""
    check(await hostile.forged_puts("127.0.0.21"))


async def test_a_malicious_first_replica_never_gets_a_forgery_served() -> None:
    """The first owner of every chunk serves forgeries of five kinds: each is detected and never served, and the
    honest second replica serves the victim exactly."""
    check(await hostile.malicious_replica("127.0.0.22", "127.0.0.23"))


async def test_one_lookup_through_slow_or_silent_peers_ends_within_its_read_deadline() -> None:
    """Regression: 32 chunks over a peer answering each request just under the request timeout took 4.2 s
    against a 1.0 s deadline. Now the lookup's exists and every get window share one deadline."""
    for outcome in await hostile.slow_and_silent_peers("127.0.0.24"):
        assert outcome.time_to_miss_s < hostile.OPTIONS.read_deadline + 0.25, outcome


async def test_the_server_survives_a_fuzzer_and_keeps_serving() -> None:
    """Random and mutated requests never get a wrong byte served; the victim is served throughout, memory stays
    flat, and most are refused."""
    outcome = await hostile.fuzzer("127.0.0.25")
    check(outcome, all_detected=False)  # some mutations are still valid requests, answered as such
    assert outcome.detected > outcome.attempts // 2, outcome


async def test_a_client_that_never_reads_cannot_starve_others() -> None:
    """Regression: 3000 unread GETs took the server down for seconds. Now that client holds only its own
    in-flight slots (the rest are refused BUSY) and the victim is served throughout."""
    outcome = await hostile.non_reading_client("127.0.0.26")
    check(outcome, all_detected=False)
    assert outcome.detected >= outcome.attempts - hostile.NON_READER_IN_FLIGHT, outcome  # the rest: refused BUSY


@pytest.mark.parametrize("attack", ["frame_flood", "oversized_payload"])
async def test_a_payload_that_breaks_its_header_is_refused_and_nothing_of_it_is_kept(attack: str) -> None:
    """Regression: 1M tiny frames blocked every client for more than 10 s and added about 600 MiB; 1 GiB
    behind a 100-byte header was buffered before the refusal. Now the parts are read and dropped one at a
    time, the request is refused, memory stays flat and the victim is served right after. (While the
    parts drain, the server reads no other request: libzmq delivers messages whole; docs/security.md.)"""
    outcome = await getattr(hostile, attack)("127.0.0.27")
    check(outcome)
    assert outcome.time_to_miss_s < 15, outcome


async def test_tenants_cannot_read_or_touch_each_others_chunks(tmp_path: Path) -> None:
    """Tenant B's reads, probes, deletes and overwrites of A's chunks, its squat on A's pinned namespace and writes
    by A's read-only key are all refused; A keeps reading exactly."""
    check(await hostile.tenants_attack_each_other("127.0.0.29", tmp_path))

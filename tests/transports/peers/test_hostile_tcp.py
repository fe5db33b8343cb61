"""The hostile-peer suite on the tcp wire: what libzmq cannot bound (a message is buffered whole before the
server sees it), kvengine's own framing refuses before buffering. Each attack of
:mod:`tests.transports.peers.hostile_tcp` on real sockets against a ``kvengine serve --transport tcp`` process."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.transports.peers import hostile_tcp
from tests.transports.peers.hostile import OPTIONS
from tests.transports.peers.test_hostile_zmq import check

pytestmark = pytest.mark.slow


async def test_bytes_beyond_the_announced_payload_cut_the_sender_off_before_they_are_buffered() -> None:
    """A PUT announcing 100 bytes followed by 256 MiB: the bytes after the payload fail the next length check, the connection is closed within milliseconds, RSS stays flat, the victim is served throughout."""
    outcome = await hostile_tcp.byte_flood("127.0.0.31")
    check(outcome)
    assert outcome.time_to_miss_s < 5, outcome


async def test_an_oversized_header_is_refused_on_its_length_field() -> None:
    """Length fields of 4 GiB and 1 MiB close the connection on their 4 bytes; nothing of the header is read."""
    check(await hostile_tcp.oversized_header("127.0.0.32"))


async def test_stalled_connections_are_capped_per_client_and_closed_at_the_message_deadline() -> None:
    """200 connections from one client, each stalled mid-message: beyond the per-client cap they are closed at once, the rest at the message deadline; the victim never waits."""
    outcome = await hostile_tcp.slowloris("127.0.0.33")
    check(outcome)
    assert outcome.time_to_miss_s < 5, outcome


async def test_a_client_sitting_on_announced_puts_cannot_keep_others_from_the_receive_budget() -> None:
    """Regression: one client announcing a 1 GiB PUT and sending nothing held the whole shared receive budget
    until its message deadline, then reconnected and did it again, so every honest PUT waited and honest 4 KiB
    PUTs failed (0 of them stored with a 2 s deadline). Now a client holds at most its share: the 1 GiB
    announcements are refused at once, the 512 MiB ones hold half the budget until their deadline, and every
    honest 4 KiB PUT is stored within its request timeout."""
    outcome = await hostile_tcp.budget_hog("127.0.0.37")
    check(outcome, all_detected=False)  # one the server closes just as the hog stops is counted by one side only
    assert outcome.detected >= outcome.attempts, outcome
    assert outcome.time_to_miss_s < OPTIONS.request_timeout, outcome


async def test_the_server_survives_a_fuzzer_and_keeps_serving() -> None:
    """1000 random and mutated messages, each on its own connection: the server stays up, memory flat, the victim served exactly."""
    outcome = await hostile_tcp.fuzzer("127.0.0.34")
    check(outcome, all_detected=False)  # some mutations are still valid requests, answered as such
    assert outcome.detected > outcome.attempts // 2, outcome


async def test_a_client_that_never_reads_loses_its_connections_not_the_server() -> None:
    """A client that pipelines GETs on 16 connections and never reads has its connections cut after reply_timeout; the victim is served throughout."""
    outcome = await hostile_tcp.non_reading_client("127.0.0.35")
    check(outcome, all_detected=False)
    assert outcome.detected >= 1, outcome


async def test_tls_tenants_cannot_read_or_touch_each_others_chunks(tmp_path: Path) -> None:
    """Tenants by certificate fingerprint: every cross-tenant read is a miss, every write a refusal, a foreign CA's certificate gets nothing."""
    check(await hostile_tcp.tenants_attack_each_other("127.0.0.36", tmp_path))

"""One scheduler, one cache engine per tensor-parallel rank.

With tensor parallelism each worker holds its rank's shard of every page
(its KV heads), so each runs its own :class:`~kvengine.KVEngine` in a
namespace that carries the rank and world size. The scheduler half asks
every rank (:class:`RankedLookup`): a prefix is a hit only as far as
*every* rank holds it, so the answer is the minimum over the ranks. Each
rank keeps the reservation it made; its load copies only the tokens vLLM
was offered (``LoadSpec.end``), and the reservation's rest is released
when the load ends. Releases go to every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvengine.lookups import MISS, PENDING, LookupOutcome, LookupResult

from .channel import LookupClient
from .metadata import ChannelAddress


@dataclass(slots=True)
class _Pending:
    """A lookup sent to every rank, and the answers already in."""

    request_id: str
    seqs: tuple[int, ...]
    answers: dict[int, LookupResult] = field(default_factory=dict)


class RankedLookup:
    """:class:`~.channel.LookupClient`'s calls, over one channel per rank (rank order).

    Not thread-safe, like the client: vLLM's scheduler calls it from one thread.
    """

    def __init__(self, addresses: Sequence[ChannelAddress]) -> None:
        if not addresses:
            raise ValueError("no worker channel to connect to")
        self._clients = [LookupClient(a.path, a.authkey) for a in addresses]
        self._seq = 0
        self._pending: dict[int, _Pending] = {}

    @property
    def closed(self) -> bool:
        return any(c.closed for c in self._clients)

    def submit(self, request_id: str, salt: str, tokens: bytes, max_tokens: int, *,
               producer: str | None = None, computed: int = 0) -> int:
        self._seq += 1
        self._pending[self._seq] = _Pending(request_id, tuple(c.submit(request_id, salt, tokens, max_tokens,
                                                                       producer=producer, computed=computed)
                                                              for c in self._clients))
        return self._seq

    def result(self, seq: int, wait_s: float, *, until_pending: bool = False) -> LookupResult:
        """Every rank's answer to lookup ``seq`` merged (a hit as far as every rank holds it), or ``PENDING``
        while one is still out: the answers already in are kept for the next call.

        The ranks answer in parallel; this waits up to ``wait_s`` for each answer still out, in rank
        order, and returns ``PENDING`` at the first one not in by then.
        """
        pending = self._pending[seq]
        for rank, (client, rank_seq) in enumerate(zip(self._clients, pending.seqs)):
            if rank in pending.answers:
                continue
            answer = client.result(rank_seq, wait_s, until_pending=until_pending)
            if answer.outcome is LookupOutcome.PENDING:
                return PENDING
            pending.answers[rank] = answer
        del self._pending[seq]
        answers = [pending.answers[r] for r in range(len(self._clients))]
        merged = _merged(answers)
        if merged.outcome is not LookupOutcome.HIT and any(a.outcome is LookupOutcome.HIT for a in answers):
            self.release(pending.request_id)  # no hit: what some ranks reserved is not going to be loaded
        return merged

    def forget(self, seq: int) -> None:
        pending = self._pending.pop(seq, None)
        if pending is None:
            return
        for rank, (client, rank_seq) in enumerate(zip(self._clients, pending.seqs)):
            if rank not in pending.answers:
                client.forget(rank_seq)

    def release(self, request_id: str) -> None:
        for client in self._clients:
            client.release(request_id)

    def close(self) -> None:
        for client in self._clients:
            client.close()


def _merged(answers: Sequence[LookupResult]) -> LookupResult:
    """The ranks' answers as one: a failure on any rank fails it (naming the ranks); a hit reaches as far as
    every rank's does (a rank's miss makes it a miss); a shadow check recomputes what every rank would."""
    failed = "; ".join(f"rank {r}: {a.error}" for r, a in enumerate(answers) if a.outcome is LookupOutcome.FAILED)
    if failed:
        return LookupResult(LookupOutcome.FAILED, error=failed)
    if all(a.outcome is LookupOutcome.SHADOWED for a in answers):
        return LookupResult(LookupOutcome.SHADOWED, min(a.tokens for a in answers))
    reach = min(a.loadable for a in answers)
    return LookupResult(LookupOutcome.HIT, reach) if reach else MISS

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

from .channel import LookupClient, Reply
from .metadata import ChannelAddress


@dataclass(slots=True)
class _Pending:
    """A lookup sent to every rank, and the replies already in."""

    request_id: str
    seqs: tuple[int, ...]
    replies: dict[int, Reply] = field(default_factory=dict)


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

    def result(self, seq: int, wait_s: float, *, until_pending: bool = False) -> Reply | None:
        """Every rank's reply to lookup ``seq`` merged (tokens every rank holds), or None while one is
        still out: the replies already in are kept for the next call.

        The ranks answer in parallel; this waits up to ``wait_s`` for each reply still out, in rank
        order, and returns None at the first one not in by then.
        """
        pending = self._pending[seq]
        for rank, (client, rank_seq) in enumerate(zip(self._clients, pending.seqs)):
            if rank in pending.replies:
                continue
            reply = client.result(rank_seq, wait_s, until_pending=until_pending)
            if reply is None:
                return None
            pending.replies[rank] = reply
        del self._pending[seq]
        replies = [pending.replies[r] for r in range(len(self._clients))]
        matched = min(x.matched_tokens for x in replies)
        if matched == 0 and any(x.matched_tokens for x in replies):
            self.release(pending.request_id)  # no hit: what some ranks reserved is not going to be loaded
        errors = "; ".join(f"rank {r}: {x.error}" for r, x in enumerate(replies) if x.error)
        return Reply(seq, matched_tokens=matched, shadow_tokens=min(x.shadow_tokens for x in replies),
                     error=errors)

    def forget(self, seq: int) -> None:
        pending = self._pending.pop(seq, None)
        if pending is None:
            return
        for rank, (client, rank_seq) in enumerate(zip(self._clients, pending.seqs)):
            if rank not in pending.replies:
                client.forget(rank_seq)

    def release(self, request_id: str) -> None:
        for client in self._clients:
            client.release(request_id)

    def close(self) -> None:
        for client in self._clients:
            client.close()

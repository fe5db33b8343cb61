"""What a lookup can return, from the engine to an inference engine's scheduler: one type.

A scheduler asks, before it schedules a request, how many of its tokens the cache supplies. The answer is
one :class:`LookupResult`, from the engine (:meth:`CacheEngine.lookup <kvengine.core.engine.CacheEngine.lookup>`,
:meth:`KVEngine.lookup <kvengine.facade.KVEngine.lookup>`) through an integration to the scheduler: its
:class:`LookupOutcome` says what happened, ``tokens`` how far a hit reaches (or how many tokens a shadow
check recomputes), and, in the process that made it, the engine's
:class:`~kvengine.core.reservations.Reservation` behind it: what the engine's ``load`` and ``release``
end. Between processes (the vLLM channel) the same type travels without the reservation, which stays with
the engine that pins its chunks.

The engine answers HIT or MISS. The other outcomes are an integration's: a shadow check sampled, an answer
not ready (a lookup on its way to a lower tier), a deadline passed, a broken way to the engine.
Only :attr:`LookupOutcome.HIT` may be loaded; every other outcome means "compute it": nothing is read.
The keyed store's per-key answers (:class:`~kvengine.keyed.GetOutcome`) are a fetch's, not a lookup's:
a keyed get copies the chunk out in the same call, so nothing is reserved between the two.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvengine.core.reservations import Reservation


class LookupOutcome(enum.Enum):
    HIT = "hit"  # ``tokens`` reserved for loading (pinned until loaded or released)
    MISS = "miss"  # nothing cached, or nothing this request may read
    SHADOWED = "shadowed"  # a hit sampled for a shadow check: its ``tokens`` recomputed and compared, not loaded
    PENDING = "pending"  # not answered yet (a promotion from a lower tier): ask again; nothing waits meanwhile
    TIMED_OUT = "timed_out"  # unanswered by its deadline: read nothing, and the answer stands (counted)
    FAILED = "failed"  # the lookup raised, or the way to the engine broke: read nothing (counted; ``error``)


@dataclass(frozen=True, slots=True)
class LookupResult:
    """One lookup's answer (see the module docs)."""

    outcome: LookupOutcome
    #: HIT: the token the hit ends at (counted from token 0); SHADOWED: the tokens to recompute; else 0
    tokens: int = 0
    #: FAILED: what failed
    error: str = ""
    #: In the process that made it, the engine's reservation (a HIT's pins; a MISS's entry in the engine's table,
    #: so asking again counts nothing): ended by the engine's load or release. Never sent to another process.
    reservation: Reservation | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        counted = self.outcome in (LookupOutcome.HIT, LookupOutcome.SHADOWED)
        if (self.tokens <= 0) if counted else self.tokens:
            raise ValueError(f"a {self.outcome.value} lookup with {self.tokens} tokens: a hit or shadow check has "
                             "some, every other outcome none")

    @classmethod
    def of(cls, reservation: Reservation) -> LookupResult:
        """The engine's answer: a hit where it reserved tokens, else a miss (nothing pinned); either way with
        ``reservation``, which the caller ends by a load or a release."""
        if reservation.matched_tokens:
            return cls(LookupOutcome.HIT, reservation.matched_tokens, reservation=reservation)
        return cls(LookupOutcome.MISS, reservation=reservation)

    @property
    def loadable(self) -> int:
        """The tokens a load may take: a hit's, else 0."""
        return self.tokens if self.outcome is LookupOutcome.HIT else 0

    def __reduce__(self) -> tuple[object, tuple[str, int, str]]:
        # The wire form (pickled on the vLLM channel, once per lookup): the outcome's value, the tokens and the
        # error; never the reservation, which stays with the engine that pins its chunks.
        return _received, (self.outcome.value, self.tokens, self.error)


def _received(outcome: str, tokens: int, error: str) -> LookupResult:
    return LookupResult(LookupOutcome(outcome), tokens, error)


MISS = LookupResult(LookupOutcome.MISS)
PENDING = LookupResult(LookupOutcome.PENDING)
TIMED_OUT = LookupResult(LookupOutcome.TIMED_OUT)

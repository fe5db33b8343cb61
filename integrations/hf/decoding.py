"""How kvengine's own generate loop picks each token: sampling, and what it takes from the generation config.

* :class:`Sampling` - greedy, or seeded temperature / top-k sampling (the loop's own argument).
* :class:`DecodingRules` - the fields of the model's ``generation_config`` the loop honours, as
  transformers' ``generate`` applies them: ``eos_token_id`` (stops), ``forced_bos_token_id`` (the first
  token after a one-token decoder prompt) and ``forced_eos_token_id`` (the last of ``max_new_tokens``).
  Fields that would make the model's own ``generate`` pick other tokens and that the loop does not
  implement (:data:`UNHONOURED`) are refused by name when set, never silently ignored. Sampling and
  length come from the loop's arguments (``sampling``, ``max_new_tokens``), not from the generation config.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvengine.errors import InvalidRequestError


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampling:
    """Greedy when ``temperature == 0``; otherwise temperature / top-k sampling with ``seed``."""

    temperature: float = 0.0
    top_k: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise InvalidRequestError("temperature must be >= 0")
        if self.top_k is not None and self.top_k <= 0:
            raise InvalidRequestError("top_k must be positive")


GREEDY = Sampling()


def _set(value: Any) -> bool:
    return value is not None


def _above(limit: float) -> Callable[[Any], bool]:
    return lambda value: value is not None and value > limit


def _not(neutral: float) -> Callable[[Any], bool]:
    return lambda value: value is not None and value != neutral


#: Generation-config fields under which transformers' ``generate`` picks other tokens (logits processors,
#: stopping criteria, search strategies) and kvengine's loop does not implement them: field -> "is it in
#: effect" (the condition transformers applies it under).
UNHONOURED: dict[str, Callable[[Any], bool]] = {
    "repetition_penalty": _not(1.0),
    "encoder_repetition_penalty": _not(1.0),
    "no_repeat_ngram_size": _above(0),
    "encoder_no_repeat_ngram_size": _above(0),
    "bad_words_ids": _set,
    "sequence_bias": _set,
    "suppress_tokens": _set,
    "begin_suppress_tokens": _set,
    "min_length": _above(0),
    "min_new_tokens": _above(0),
    "exponential_decay_length_penalty": _set,
    "guidance_scale": _not(1.0),
    "remove_invalid_values": lambda value: value is True,
    "num_beams": _above(1),
    "penalty_alpha": _set,
    "num_return_sequences": _above(1),
    "stop_strings": _set,
    "max_time": _set,
    "watermarking_config": _set,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodingRules:
    """What the loop takes from the model's generation config: stop ids and forced first / last tokens."""

    stops: frozenset[int]
    forced_bos: int | None = None
    forced_eos: tuple[int, ...] = ()

    @classmethod
    def of(cls, model: Any, eos_token_id: int | Sequence[int] | None = -1) -> DecodingRules:
        """The rules for one request; ``eos_token_id=-1`` means the generation config's, None never stops.

        :raises InvalidRequestError: the generation config sets a field the loop does not honour, named.
        """
        config = getattr(model, "generation_config", None)
        in_effect = [f"{name}={getattr(config, name)!r}" for name, active in UNHONOURED.items()
                     if active(getattr(config, name, None))]
        if in_effect:
            raise InvalidRequestError(
                f"the model's generation config sets {', '.join(in_effect)}, which kvengine's generate does not "
                "apply (it honours eos_token_id, forced_bos_token_id and forced_eos_token_id; sampling and length "
                "come from its arguments): unset them in model.generation_config (or use "
                "AttachedModel.model_generate, the model's own generate, where the family allows it)")
        eos = getattr(config, "eos_token_id", None) if eos_token_id == -1 else eos_token_id
        forced_eos = getattr(config, "forced_eos_token_id", None)
        return cls(stops=frozenset(_ids(eos)), forced_bos=getattr(config, "forced_bos_token_id", None),
                   forced_eos=tuple(_ids(forced_eos)))

    def constrain(self, scores: torch.Tensor, *, length: int, last: bool) -> torch.Tensor:
        """``scores`` (``[vocab]``) of the token after ``length`` tokens, ``last`` of the request, as
        transformers' ``ForcedBOSTokenLogitsProcessor`` then ``ForcedEOSTokenLogitsProcessor`` leave them:
        every other token at -inf, the forced ones at 0."""
        if self.forced_bos is not None and length == 1:
            scores = _only(scores, (self.forced_bos,))
        if self.forced_eos and last:
            scores = _only(scores, self.forced_eos)
        return scores


def _ids(value: int | Sequence[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def _only(scores: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
    out = torch.full_like(scores, float("-inf"))
    out[list(ids)] = 0
    return out


def sample(logits: torch.Tensor, sampling: Sampling, rng: torch.Generator, rules: DecodingRules, *,
           length: int, last: bool) -> int:
    """The next token from the logits after ``length`` tokens (see :meth:`DecodingRules.constrain`)."""
    scores = rules.constrain(logits.float(), length=length, last=last)
    if sampling.temperature == 0:
        return int(torch.argmax(scores))
    scores = scores / sampling.temperature
    if sampling.top_k is not None:
        k = min(sampling.top_k, scores.numel())
        kth = torch.topk(scores, k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=rng))

"""A transformers decoder run one layer at a time over a chosen subset of a prompt's tokens, the others'
KV read from a table: what selective recompute needs (CacheBlend picks its tokens at a check layer, between
layers) and what a model's ``forward`` does not offer.

The subset is computed with its own positions against the table's KV for every other token, under a causal
mask by position; the table need not be in position order inside a layer, only the mask must be. This runs
the model's own modules (embedding, rotary embedding, decoder layers, final norm, output head), not a copy
of their arithmetic, but the loop that strings them together is ours: :class:`LayerwiseForward` proves it
against the model's ``forward`` when built and refuses a model where the two differ (an embedding scale, a
layer with other inputs), rather than blend it wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvengine.errors import UnsupportedModelError

#: Largest difference from the model's own forward the proof accepts (float32 models, reordered sums).
PROOF_ATOL = 1e-4


@dataclass(frozen=True)
class KVTable:
    """Per layer, the KV of every prompt token (``[1, kv_heads, n, head_dim]``), in position order."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]


@dataclass(frozen=True)
class LayerwiseResult:
    """The prompt's KV after the run (computed tokens' fresh, the others' from the table), and the logits
    after its last token."""

    table: KVTable
    logits: torch.Tensor  # [vocab]
    #: Tokens computed at every layer (a bool mask over the prompt), including those a check layer chose.
    computed: torch.Tensor


class _RowCache:
    """The cache an attention layer sees for one run of one layer: the table's rows for tokens not computed,
    then the computed tokens' fresh KV (recorded for the caller)."""

    def __init__(self, keys: torch.Tensor | None, values: torch.Tensor | None) -> None:
        self.keys, self.values = keys, values
        self.fresh: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int,
               cache_kwargs: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        self.fresh = (keys, values)
        if self.keys is None or self.values is None:
            return keys, values
        return torch.cat([self.keys, keys], dim=2), torch.cat([self.values, values], dim=2)


class LayerwiseForward:
    """Runs ``model`` layer by layer (see the module's docstring). Proved at construction.

    :raises UnsupportedModelError: the model lacks a part the loop needs, or the loop does not reproduce its
        forward.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        inner = getattr(model, "model", None)
        parts = {name: getattr(inner, name, None) for name in ("embed_tokens", "rotary_emb", "layers", "norm")}
        missing = [name for name, part in parts.items() if part is None]
        if missing or model.get_output_embeddings() is None:
            raise UnsupportedModelError(f"{model.config.model_type}: no {', '.join(missing) or 'output head'} "
                                        "where a decoder-only model keeps it, so it cannot run layer by layer")
        self._embed: Any = parts["embed_tokens"]
        self._rotary: Any = parts["rotary_emb"]
        self._norm: Any = parts["norm"]
        self._layers = list(parts["layers"] or ())[: model.config.get_text_config(decoder=True).num_hidden_layers]
        self._head: Any = model.get_output_embeddings()
        self._prove()

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def run(self, ids: torch.Tensor, table: KVTable | None, computed: torch.Tensor, *,
            choose: tuple[int, int, torch.Tensor] | None = None) -> LayerwiseResult:
        """Run ``ids`` (``[1, n]``, positions ``0..n``), computing the tokens in ``computed`` (bool ``[n]``, the
        last token among them) at every layer and reading the others' KV from ``table``.

        ``choose = (layer, count, candidates)``: every token is computed up to and including ``layer``; there,
        the ``count`` tokens among ``candidates`` whose fresh KV deviates most from the table's are added to
        ``computed`` for the layers after it (CacheBlend's rule).
        """
        n = int(ids.shape[1])
        if not bool(computed[-1]):
            raise ValueError("the last token must be computed: the logits follow it")
        if table is None and not bool(computed.all()):
            raise ValueError("tokens not computed need a KV table to read from")
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        with torch.no_grad():
            hidden = self._embed(ids)
            active = torch.ones(n, dtype=torch.bool) if choose else computed
            plan = _Plan.of(active, hidden, self._rotary)
            for index, layer in enumerate(self._layers):
                base_k = table.keys[index][:, :, plan.kept] if table is not None else None
                base_v = table.values[index][:, :, plan.kept] if table is not None else None
                cache = _RowCache(base_k, base_v)
                out = layer(hidden[:, plan.rows], attention_mask=plan.mask, position_ids=plan.rows[None],
                            past_key_values=cache, position_embeddings=plan.rotary)
                hidden[:, plan.rows] = out[0] if isinstance(out, tuple) else out
                assert cache.fresh is not None, "the attention layer did not write its KV"
                fresh_k, fresh_v = cache.fresh
                layer_k = fresh_k.new_empty((*fresh_k.shape[:2], n, fresh_k.shape[3]))
                layer_v = fresh_v.new_empty((*fresh_v.shape[:2], n, fresh_v.shape[3]))
                layer_k[:, :, plan.rows], layer_v[:, :, plan.rows] = fresh_k, fresh_v
                if base_k is not None and base_v is not None:
                    layer_k[:, :, plan.kept], layer_v[:, :, plan.kept] = base_k, base_v
                if choose and index == choose[0]:
                    assert table is not None
                    active = computed | _most_deviating(layer_k, layer_v, table.keys[index], table.values[index],
                                                        choose[2], choose[1])
                    plan = _Plan.of(active, hidden, self._rotary)
                keys.append(layer_k)
                values.append(layer_v)
            logits = self._head(self._norm(hidden[:, -1:]))[0, -1]
        return LayerwiseResult(KVTable(keys, values), logits, active)

    def _prove(self) -> None:
        """Run a probe through the loop twice (every token computed; then most read from the model's own KV)
        and compare each with the model's forward: the loop must reproduce it."""
        g = torch.Generator().manual_seed(38)
        vocab = int(self.model.config.get_text_config(decoder=True).vocab_size)
        ids = torch.randint(0, vocab, (1, 24), generator=g)
        with torch.no_grad():
            out = self.model(ids, use_cache=True)
        reference = KVTable([layer.keys for layer in out.past_key_values.layers],
                            [layer.values for layer in out.past_key_values.layers])
        some = torch.zeros(24, dtype=torch.bool)
        some[[3, 9, 10, 17, 23]] = True
        try:
            runs = [self.run(ids, None, torch.ones(24, dtype=torch.bool)), self.run(ids, reference, some)]
        except Exception as exc:
            raise UnsupportedModelError(f"{self.model.config.model_type}: its layers cannot run one at a time "
                                        f"({type(exc).__name__}: {exc})") from exc
        for run in runs:
            gaps = [float((run.logits - out.logits[0, -1]).abs().max())]
            gaps += [float((a - b).abs().max()) for a, b in zip(run.table.keys, reference.keys)]
            if max(gaps) > PROOF_ATOL * max(1.0, float(out.logits.abs().max())):
                raise UnsupportedModelError(f"{self.model.config.model_type}: running its layers one at a time "
                                            f"differs from its forward by {max(gaps):.3g}, so it cannot blend")


@dataclass(frozen=True)
class _Plan:
    """What every layer of one computed set shares: the computed rows (their positions), the others, the
    attention mask and the rotary embeddings of the computed positions."""

    rows: torch.Tensor
    kept: torch.Tensor
    mask: torch.Tensor
    rotary: Any

    @classmethod
    def of(cls, active: torch.Tensor, hidden: torch.Tensor, rotary: Any) -> _Plan:
        rows, kept = active.nonzero().flatten(), (~active).nonzero().flatten()
        return cls(rows, kept, _mask(kept, rows, hidden.dtype), rotary(hidden, position_ids=rows[None]))


def _mask(kept: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask of queries at positions ``rows`` over keys at ``kept`` then ``rows`` (the order
    :class:`_RowCache` concatenates them in): a key is visible iff its position is not after the query's."""
    key_positions = torch.cat([kept, rows])
    visible = key_positions[None, :] <= rows[:, None]
    mask = torch.zeros(visible.shape, dtype=dtype)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]


def _most_deviating(keys: torch.Tensor, values: torch.Tensor, table_keys: torch.Tensor, table_values: torch.Tensor,
                    candidates: torch.Tensor, count: int) -> torch.Tensor:
    """A bool mask of the ``count`` candidate tokens whose fresh KV is farthest from the table's (squared
    distance over heads and dimensions, keys and values together)."""
    chosen = torch.zeros_like(candidates)
    if count <= 0:
        return chosen
    deviation = ((keys - table_keys).float().pow(2).sum(dim=(0, 1, 3))
                 + (values - table_values).float().pow(2).sum(dim=(0, 1, 3)))
    deviation[~candidates] = -1.0
    count = min(count, int(candidates.sum()))
    chosen[deviation.topk(count).indices] = True
    return chosen

"""One forward pass of a transformers model over a cache, with explicit positions.

The runner hides the per-family calling conventions: decoder-only models get
``past_key_values`` and explicit ``position_ids``; Mamba-style models take
``cache_params`` and have no positions; encoder-decoder models get the
encoder outputs and derive decoder positions from the self-attention cache
length (which a restore sets).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers.cache_utils import Cache

from kvengine.semantics.spec import ModelKVSpec


class ModelRunner:
    """Calls ``model`` for a piece of tokens that starts at absolute position ``start``."""

    def __init__(self, model: Any, spec: ModelKVSpec) -> None:
        self.model = model
        self.spec = spec
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache_params" if "cache_params" in params and "past_key_values" not in params else (
            "past_key_values")
        self.explicit_positions = "position_ids" in params and not spec.encoder_decoder
        self.logits_to_keep = "logits_to_keep" in params
        #: Fault-injection hook for tests of the attach canary; always 0 in production.
        self.position_offset = 0

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def forward(
        self,
        ids: torch.Tensor,
        cache: Cache,
        start: int,
        *,
        encoder_outputs: Any = None,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Logits ``[n, vocab]`` (all positions) or ``[1, vocab]`` (last) for 1-D ``ids`` at ``start``."""
        n = int(ids.shape[-1])
        ids = ids.reshape(1, n).to(self.device)
        kwargs: dict[str, Any] = {self.cache_kw: cache, "use_cache": True}
        if self.explicit_positions:
            pos = torch.arange(start, start + n, device=self.device) + self.position_offset
            kwargs["position_ids"] = pos.unsqueeze(0)
        if self.logits_to_keep and not all_logits:
            kwargs["logits_to_keep"] = 1
        if self.spec.encoder_decoder:
            out = self.model(encoder_outputs=encoder_outputs, decoder_input_ids=ids, **kwargs)
        else:
            out = self.model(input_ids=ids, **kwargs)
        logits = out.logits[0]
        return logits if all_logits else logits[-1:]

    @torch.no_grad()
    def encode(self, encoder_ids: torch.Tensor) -> Any:
        """Encoder outputs of a 1-D encoder input (encoder-decoder models)."""
        ids = encoder_ids.reshape(1, -1).to(self.device)
        return self.model.get_encoder()(input_ids=ids, return_dict=True)

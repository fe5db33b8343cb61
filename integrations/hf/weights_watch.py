"""Noticing, before each request and cheaply, that an attached model's weights, dtype or device changed.

A fine-tuning step, a LoRA merge or ``load_state_dict`` changes a model in
place: same object, same config, new KV. Hashing every byte before every
request is the only complete check, and costs a pass over the weights. This
watch costs a few microseconds per tensor and sees:

* version counters: every in-place op on a parameter or buffer (optimizer
  steps, ``load_state_dict``, ``copy_`` under ``no_grad``);
* storage pointers and shapes: parameters or buffers replaced (``.data = ...``,
  ``to()``, a new module);
* a sample of each tensor's elements: in-place edits through ``.data``, which
  bypass version counters (how some LoRA merges write).

A change it reports is confirmed with the full content hash (a tensor moved
but unchanged keeps its namespace). What it cannot see (``.data`` edits of
only unsampled elements) is left to shadow verification.

:class:`ModelWatch` turns that into what an attached model acts on: a
:class:`ModelChange` (new content digest, new :class:`ModelForm`: dtype and
device), or None.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

_SAMPLES = 16


def model_fingerprint(model: Any, *, weights: bool = True) -> str:
    """Digest of the config and (by default) every parameter and buffer's bytes, non-persistent buffers
    included: they are outside ``state_dict`` but the KV depends on them (RoPE's ``inv_freq``, which a
    round trip through bfloat16 rounds)."""
    h = xxhash.xxh3_128()
    h.update(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    if weights:
        tensors = dict(itertools.chain(model.named_parameters(), model.named_buffers()))
        for name, tensor in sorted(tensors.items()):
            h.update(name.encode())
            h.update(str(tensor.dtype).encode() + str(tuple(tensor.shape)).encode())
            t = tensor.detach().reshape(-1).contiguous().cpu()  # 0-d buffers (a scale) too
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class WeightsWatch:
    """A cheap token of a model's parameters and buffers; :meth:`changed` compares it with the last one."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self._index: dict[int, torch.Tensor] = {}
        self._token = self._read()

    def _sample_index(self, numel: int) -> torch.Tensor:
        index = self._index.get(numel)
        if index is None:
            # Integer arithmetic: a float32 linspace rounds indices above 2**24 (a real model's
            # embedding) up past the last element.
            n = min(_SAMPLES, numel)
            index = self._index[numel] = torch.arange(n, dtype=torch.int64) * (numel - 1) // max(n - 1, 1)
        return index

    def _read(self) -> bytes:
        h = xxhash.xxh3_128()
        tensors = itertools.chain(self._model.named_parameters(), self._model.named_buffers())
        with torch.no_grad():
            for name, t in tensors:
                h.update(f"{name}\0{t.data_ptr()}\0{t._version}\0{tuple(t.shape)}\0{t.dtype}\0".encode())
                if t.numel():
                    sample = t.detach().reshape(-1)[self._sample_index(t.numel())].cpu().contiguous()
                    h.update(sample.view(torch.uint8).numpy().tobytes())
        return h.digest()

    def changed(self) -> bool:
        """Whether anything it watches differs from the last call (or construction)."""
        token = self._read()
        if token == self._token:
            return False
        self._token = token
        return True


@dataclass(frozen=True, slots=True)
class ModelForm:
    """What a model's KV is computed in, besides its weights: its dtype (part of the KV spec) and the
    device it runs on (kernels, and where restored caches live)."""

    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, model: Any) -> ModelForm:
        return cls(model.dtype, next(model.parameters()).device)

    def describe(self, new: ModelForm) -> str:
        """What changed from ``self`` to ``new``, in words ("dtype changed from float32 to bfloat16")."""
        parts = []
        if new.dtype != self.dtype:
            parts.append(f"dtype changed from {_name(self.dtype)} to {_name(new.dtype)}")
        if new.device != self.device:
            parts.append(f"moved from {self.device} to {new.device}")
        return " and ".join(parts) or "weights changed"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class ModelChange:
    """A change of an attached model not yet accepted: its new content digest and form."""

    content: str
    form: ModelForm
    previous: ModelForm

    @property
    def form_changed(self) -> bool:
        return self.form != self.previous

    def describe(self) -> str:
        return self.previous.describe(self.form)


class ModelWatch:
    """The accepted identity of an attached model (content digest and form) and what differs from it.

    :meth:`poll` costs one :class:`WeightsWatch` token while nothing changes; after a change of the
    token it confirms with the full content hash (moved but unchanged bytes, or changed back, is no change).
    """

    def __init__(self, model: Any, content: str) -> None:
        self._model = model
        self._weights = WeightsWatch(model)
        self.content = content
        self.form = ModelForm.of(model)

    def poll(self) -> ModelChange | None:
        """What differs from the accepted identity, or None; judged afresh only when the token moved."""
        if not self._weights.changed():
            return None
        content, form = model_fingerprint(self._model), ModelForm.of(self._model)
        if content == self.content and form == self.form:
            return None
        return ModelChange(content=content, form=form, previous=self.form)

    def accept(self, change: ModelChange) -> None:
        self.content, self.form = change.content, change.form

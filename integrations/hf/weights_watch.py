"""Noticing, before each request and cheaply, that an attached model's weights changed.

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
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import torch
import xxhash

_SAMPLES = 16


def model_fingerprint(model: Any, *, weights: bool = True) -> str:
    """Digest of the config and (by default) every parameter and buffer's bytes."""
    h = xxhash.xxh3_128()
    h.update(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    if weights:
        for name, tensor in sorted(model.state_dict().items()):
            h.update(name.encode())
            h.update(str(tensor.dtype).encode() + str(tuple(tensor.shape)).encode())
            t = tensor.detach().contiguous().cpu()
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

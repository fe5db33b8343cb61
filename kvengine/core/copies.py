"""Copying chunks' tensors between the cache and an inference engine's memory."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def copy_all(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """Copy tensor-wise; one dispatch for many tensors (per-layer layouts have dozens). Never recorded
    by autograd: cached KV is data, whatever the caller's tensors track."""
    with torch.no_grad():
        if len(dst) == 1:
            dst[0].copy_(src[0])
        else:
            torch._foreach_copy_(list(dst), list(src))

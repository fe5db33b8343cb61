"""Copying chunks' tensors between the cache and an inference engine's memory."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def copy_all(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """Copy tensor-wise, as few copies as possible. Never recorded by autograd: cached KV is data,
    whatever the caller's tensors track.

    Per-layer layouts hand over dozens of tensors per chunk. When each side's tensors are evenly spaced
    views of one buffer (a chunk's slot always is; an engine's layers often are: one allocation, a
    layer stride), both sides are copied as one stacked view: one copy, one parallel region for the
    threads, instead of one per tensor.
    """
    grad = torch.is_grad_enabled()
    if grad:  # torch's own switch, not ``torch.no_grad()``: its context object costs more than the copy here
        torch._C._set_grad_enabled(False)
    try:
        if len(dst) == 1:
            dst[0].copy_(src[0])
        elif (stacked_dst := stacked_view(dst)) is not None and (stacked_src := stacked_view(src)) is not None:
            stacked_dst.copy_(stacked_src)
        else:
            torch._foreach_copy_(list(dst), list(src))
    finally:
        if grad:
            torch._C._set_grad_enabled(True)


def stacked_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``torch.stack(tensors)`` as a view, without copying, when the tensors are views of one storage
    with one shape, dtype and strides, starting a constant number of elements apart; else None.

    The view is read from and written to in place; it aliases exactly the tensors' elements only if
    they do not overlap, which a constant start spacing does not prove, so a view whose tensors
    would overlap (spacing smaller than one tensor's extent) is refused.
    """
    first = tensors[0]
    if len(tensors) < 2 or first.device.type != "cpu" or first.numel() == 0:
        return None
    storage, shape, stride, dtype = first.untyped_storage().data_ptr(), first.shape, first.stride(), first.dtype
    spacing = tensors[1].storage_offset() - first.storage_offset()
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, stride))  # elements from the first to the last, inclusive
    if spacing < extent:
        return None
    for i, t in enumerate(tensors):
        if (t.untyped_storage().data_ptr() != storage or t.shape != shape or t.stride() != stride
                or t.dtype != dtype or t.storage_offset() != first.storage_offset() + i * spacing):
            return None
    return first.as_strided((len(tensors), *shape), (spacing, *stride), first.storage_offset())

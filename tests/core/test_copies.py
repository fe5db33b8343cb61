"""Chunk copies: per-layer tensors copied as one stacked view when both sides allow it, tensor-wise otherwise."""

from __future__ import annotations

import pytest
import torch

from kvengine.core.copies import copy_all, stacked_view


def test_evenly_spaced_views_of_one_buffer_stack_without_copying():
    """Layers of one allocation (a layer stride apart), sliced in tokens: the stack is a view of the same
    elements, and writing through it writes the layers."""
    parent = torch.zeros(4, 2, 64, 3)
    layers = list(parent[:, :, 8:40].unbind(0))
    stacked = stacked_view(layers)
    assert stacked is not None and stacked.data_ptr() == layers[0].data_ptr()
    assert torch.equal(stacked, torch.stack(layers))
    stacked.fill_(7.0)
    assert (parent[:, :, 8:40] == 7).all() and (parent[:, :, :8] == 0).all() and (parent[:, :, 40:] == 0).all()


@pytest.mark.parametrize("make", [
    lambda: [torch.zeros(2, 8), torch.zeros(2, 8)],  # separate storages
    lambda: (lambda base: [base[0], base[1], base[3]])(torch.zeros(8, 2, 8)),  # layers 0, 1, 3: uneven spacing
    lambda: (lambda base: [base[i:i + 8] for i in (0, 4, 8)])(torch.zeros(64)),  # overlapping (spacing < extent)
    lambda: (lambda base: [base[0:8].view(2, 4), base[8:16].view(4, 2)])(torch.zeros(64)),  # shapes differ
    lambda: (lambda base: [base[0:8], base[8:24:2]])(torch.zeros(64)),  # strides differ
    lambda: (lambda base: [base[0:8], base[8:16], base[20:28]])(torch.zeros(64)),  # spacing changes late
    lambda: [torch.zeros(4)[0:0], torch.zeros(4)[0:0]],  # empty
])
def test_tensors_that_are_no_even_stack_of_one_buffer_are_refused(make):
    assert stacked_view(make()) is None


@pytest.mark.parametrize("stackable_dst, stackable_src", [(True, True), (True, False), (False, True)])
def test_copy_all_copies_every_tensor_whichever_path_it_takes(stackable_dst, stackable_src):
    """Same result stacked or tensor-wise; nothing outside the tensors is written."""
    g = torch.Generator().manual_seed(0)
    src_parent = torch.randn(6, 2, 32, 4, generator=g)
    src = list(src_parent[:, :, 4:20].unbind(0)) if stackable_src else [t.clone() for t in src_parent[:, :, 4:20]]
    dst_parent = torch.zeros(6, 2, 16, 4)
    dst = list(dst_parent.unbind(0)) if stackable_dst else [torch.zeros(2, 16, 4) for _ in range(6)]
    copy_all(dst, src)
    for d, s in zip(dst, src):
        assert torch.equal(d, s)
    assert torch.equal(src_parent[:, :, 4:20], torch.stack(src)) and (src_parent[:, :, 4:20] == torch.stack(dst)).all()

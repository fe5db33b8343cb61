"""The HF integration's cheap weights token (``WeightsWatch``) on tensors of real-model size."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kvengine.integrations.hf.weights_watch import WeightsWatch


def test_a_tensor_above_2_pow_24_elements_is_sampled_up_to_its_last_element():
    """Regression: a float32 linspace rounded the last sample index of a 28M-element embedding (SmolLM2's)
    past the tensor's end, so attach raised IndexError on the first real model. Sampled indices stay in
    range, and an edit of the last element through ``.data`` (no version bump) is seen."""
    module = torch.nn.Module()
    module.register_buffer("table", torch.zeros(2**24 + 4))
    watch = WeightsWatch(module)
    assert not watch.changed()
    module.table.data[-1] = 1.0
    assert watch.changed()

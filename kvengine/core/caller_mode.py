"""Callbacks of a caller (sinks, sources) run on the engine's threads in the caller's torch modes."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
T = TypeVar("T")


def in_callers_mode(fn: Callable[P, T]) -> Callable[P, T]:
    """``fn``, run under the inference and grad modes of the thread that calls this, wherever it runs.

    Both modes are thread-local, and the engine runs sinks and sources on its
    own threads: a sink writing into tensors made under ``torch.inference_mode()``
    (inference tensors) would fail there, and every load would become a miss.
    """
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()
    if not inference and grad:  # torch's defaults, which the engine's threads run in: nothing to carry
        return fn

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> T:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return fn(*args, **kwargs)

    return call

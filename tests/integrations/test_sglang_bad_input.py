"""The SGLang HiCache backend's caller mistakes: a clear InvalidRequestError naming the argument.

Run in .venv-sglang (see docs/sglang.md); skipped, with the reason, where SGLang is not installed.
"""

from __future__ import annotations

import pytest

from tests.integrations import sglang_env

sglang_env.require_sglang()

import torch

from kvengine import errors
from kvengine.errors import InvalidRequestError
from tests.integrations.test_sglang_backend import PAGE, fill_random, make_backend, page_keys, pages_at


@pytest.fixture
def backend_and_host():
    _, host = sglang_env.make_mha_pools("page_first")
    fill_random(host)
    backend = make_backend(host)
    yield backend, host
    backend.close()


@pytest.mark.parametrize("indices", [
    pytest.param(lambda: torch.arange(PAGE, 3 * PAGE, dtype=torch.float32), id="float-tensor"),
    pytest.param(lambda: torch.arange(PAGE, 3 * PAGE, dtype=torch.float32) + 0.5, id="fractional"),
    pytest.param(lambda: torch.ones(2 * PAGE, dtype=torch.bool), id="bool-tensor"),
    pytest.param(lambda: list(range(PAGE, 3 * PAGE)), id="list"),
    pytest.param(lambda: None, id="None"),
    pytest.param(lambda: torch.arange(PAGE, 3 * PAGE).view(2, PAGE), id="2-D"),
])
@pytest.mark.parametrize("op", ["batch_set_v1", "batch_get_v1"])
def test_host_indices_that_are_not_integer_slots_are_refused(backend_and_host, op, indices):
    """Regression: float host indices (even fractional ones) were accepted and used as slots, and None or a
    list raised AttributeError. Each is now an InvalidRequestError naming host_indices, and nothing is
    stored."""
    backend, _ = backend_and_host
    _, keys = page_keys(2)
    with pytest.raises(InvalidRequestError, match="host_indices"):
        getattr(backend, op)(keys, indices())
    assert backend.batch_exists(keys) == 0


@pytest.mark.parametrize("call,argument", [
    (lambda b, keys: b.get(keys[0], None), "target_location"),
    (lambda b, keys: b.batch_get(keys, [None, None]), r"target_locations\[0\]"),
    (lambda b, keys: b.set(keys[0], None), "value"),
    (lambda b, keys: b.batch_set(keys, [None, "page"]), r"values\[0\]"),
], ids=["get", "batch_get", "set", "batch_set"])
def test_a_flat_page_that_is_not_a_tensor_is_refused_naming_it(backend_and_host, call, argument):
    """Regression: a None target (or value) of the copying API raised AttributeError. It is now an
    InvalidRequestError naming the argument, and nothing is stored."""
    backend, _ = backend_and_host
    _, keys = page_keys(2, seed=3)
    with pytest.raises(InvalidRequestError, match=rf"{argument} must be a torch.Tensor"):
        call(backend, keys)
    assert backend.batch_exists(keys) == 0


def test_integer_indices_of_every_int_dtype_still_round_trip(backend_and_host):
    """int32 host indices (as well as SGLang's int64) address the same slots, bit-exact."""
    backend, host = backend_and_host
    _, keys = page_keys(2, seed=4)
    src = torch.arange(PAGE, 3 * PAGE, dtype=torch.int32)
    dst = torch.arange(10 * PAGE, 12 * PAGE)
    assert backend.batch_set_v1(keys, src) == [True, True]
    assert backend.batch_get_v1(keys, dst) == [True, True]
    for got, want in zip(pages_at(host, dst), pages_at(host, src.long())):
        assert torch.equal(got, want)


def test_a_call_after_close_says_the_backend_is_closed():
    """Regression: after close() a data call said the backend had "no host pool yet". It now raises
    EngineClosedError saying the backend is closed."""
    _, host = sglang_env.make_mha_pools("page_first")
    backend = make_backend(host)
    _, keys = page_keys(1)
    backend.close()
    with pytest.raises(errors.KVEngineError, match="is closed") as caught:
        backend.batch_exists(keys)
    assert type(caught.value).__name__ == "EngineClosedError"
    with pytest.raises(errors.KVEngineError, match="is closed"):
        backend.batch_set_v1(keys, torch.arange(PAGE))

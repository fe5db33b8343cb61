"""Tiny random-weight transformers models (fp32) and engines for the HF integration tests.

Shared with other integrations' tests in this directory: nothing here imports
transformers at collection time (the HF test modules skip themselves without it).
"""

from __future__ import annotations

import pytest
import torch

from kvengine import KVEngine

CHUNK = 16

#: Families in the exactness matrix; the slow ones (torch fallbacks of fused kernels) are marked.
FAST_FAMILIES = ["llama", "qwen3", "gpt2", "mistral", "gemma2", "gemma3", "deepseek_v3", "deepseek_v2",
                 "granitemoehybrid", "falcon_h1", "mamba2", "t5", "bart"]
SLOW_FAMILIES = ["qwen3_next"]


def build_tiny(family: str, **kwargs: object):
    """A tiny random model (see :mod:`kvengine.integrations.hf.tiny_models`); imports transformers lazily."""
    from kvengine.integrations.hf.tiny_models import build_tiny as build

    return build(family, **kwargs)


def family_params() -> list:
    return [*FAST_FAMILIES, *(pytest.param(f, marks=pytest.mark.slow) for f in SLOW_FAMILIES)]


def make_engine(capacity: str = "64MiB", **extra: object) -> KVEngine:
    return KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": capacity}, **extra})


def prompt_for(model, n: int, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(decoder prompt, encoder input or None) of random ids away from special tokens."""
    g = torch.Generator().manual_seed(100 + seed)
    ids = torch.randint(4, 256, (n,), generator=g)
    if not model.config.is_encoder_decoder:
        return ids, None
    ids[0] = model.config.decoder_start_token_id
    return ids, torch.randint(4, 256, (23,), generator=g)


def reference_generate(model, ids: torch.Tensor, enc: torch.Tensor | None, n: int) -> list[int]:
    """Plain transformers greedy generate, no kvengine involved."""
    with torch.no_grad():
        if enc is not None:
            out = model.generate(input_ids=enc[None], decoder_input_ids=ids[None], max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False)
        else:
            out = model.generate(ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.fixture
def engine():
    eng = make_engine()
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def tiny_llama():
    return build_tiny("llama")

"""Hugging Face transformers integration: a generate loop that reuses cached prefixes.

>>> engine = KVEngine({"chunk_size": 16, "memory": {"capacity_bytes": "256MiB"}})
>>> cached = attach(model, engine)            # derives the KV spec, runs the attach canary
>>> out = cached.generate(prompt_ids, max_new_tokens=20)
>>> out.reused_tokens, out.new_tokens
>>> run = cached.model_generate(prompt_ids, max_new_tokens=20, do_sample=False)  # the model's own generate
>>> run.output.sequences, run.reused_tokens

* :func:`attach` - fail-closed attach (canary; ``debug_unverified`` override).
* :class:`AttachedModel` - ``model_generate`` (the model's own ``generate`` over a cache kvengine
  prefilled), ``generate`` (kvengine's loop), and the restore / prefill / store steps.
* :func:`run_demo` - the multi-turn chat demo (``kvengine demo``).
* :mod:`.segments` - segments cached once and reused at any position, blended (approximate, and labelled so).
"""

from __future__ import annotations

from .attaching import attach
from .generator import AttachedModel, GenerationResult, ModelGeneration, Sampling
from .verify import run_canary
from .weights_watch import model_fingerprint


def run_demo(argv: list[str] | None = None) -> int:
    """Entry point of ``kvengine demo`` (imports the demo lazily)."""
    from .demo import run_demo as _run

    return _run(argv)


__all__ = [
    "AttachedModel", "GenerationResult", "ModelGeneration", "Sampling", "attach", "model_fingerprint", "run_canary",
    "run_demo",
]

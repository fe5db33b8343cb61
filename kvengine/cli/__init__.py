"""The ``kvengine`` command."""

from __future__ import annotations

import argparse
import importlib
import sys
import time

from kvengine.cli.arguments import positive_int
from kvengine.errors import ConfigError, InvalidRequestError, KVEngineError, UnsupportedModelError
from kvengine.trust.verification import kvengine_version


def _quickstart(args: argparse.Namespace) -> int:
    """Store a prompt's KV, look it up as a new request, load it back, verify."""
    import torch

    from kvengine.chunks.keys import Namespace
    from kvengine.chunks.layout import ChunkLayout, KVCategory, TensorSpec
    from kvengine.config import load_config
    from kvengine.facade import KVEngine

    layers, heads, head_dim, chunk = 4, 2, 64, args.chunk_size
    layout = ChunkLayout(chunk, tuple(
        TensorSpec(name=f"layer{i}.kv", group=0, category=KVCategory.FULL_ATTENTION,
                   dtype=torch.bfloat16, shape=(2, chunk, heads, head_dim), token_dim=1)
        for i in range(layers)
    ))
    tokens = torch.randint(0, 32000, (args.tokens,))
    kv = [torch.randn(2, args.tokens, heads, head_dim).to(torch.bfloat16) for _ in range(layers)]
    # --chunk-size is what the layout above was built for: the environment must not change it.
    with KVEngine(load_config({"memory": {"capacity_bytes": "64MiB"}}, overrides={"chunk_size": chunk})) as engine:
        binding = engine.bind(Namespace(model="quickstart-random"), layout)
        t0 = time.perf_counter()
        stored = engine.store(binding, tokens, lambda i, s, e: [t[:, s:e] for t in kv])
        t1 = time.perf_counter()
        res = engine.lookup(binding, "request-2", tokens, max_tokens=len(tokens) - 1)
        out = [torch.zeros_like(t) for t in kv]

        def sink(view):  # copy each chunk's layers into the request's buffers
            s, e = view.token_range
            for dst, src in zip(out, view.tensors):
                dst[:, s:e].copy_(src)

        loaded = engine.load(res, sink)
        t2 = time.perf_counter()
        exact = all(torch.equal(o[:, : loaded.loaded_tokens], k[:, : loaded.loaded_tokens]) for o, k in zip(out, kv))
        print(f"prompt tokens      {len(tokens)}")
        print(f"chunks stored      {stored.stored_chunks} ({chunk} tokens each; partial tail not stored)")
        print(f"tokens matched     {res.tokens} (at most len-1, the last token is always recomputed)")
        print(f"tokens loaded      {loaded.loaded_tokens}  failed chunks {list(loaded.failed_chunks)}")
        print(f"bytes identical    {exact}")
        print(f"store {1e3 * (t1 - t0):.2f} ms, lookup+load {1e3 * (t2 - t1):.2f} ms")
        print(f"pins after load    {engine.pinned_chunks()}")
        return 0 if exact and loaded.ok else 1


# Subcommands with their own argument parsers, imported only when used (transformers,
# zmq and friends are slow to import).
_DELEGATED = {
    "demo": ("kvengine.integrations.hf", "run_demo", "multi-turn chat with a tiny local model, with and without the cache"),
    "inspect": ("kvengine.cli.inspect", "main", "show a model's KV spec and reuse plan from its config.json"),
    "serve": ("kvengine.cli.serve", "main", "run a standalone peer server with a store of its own (memory or --disk)"),
    "host": ("kvengine.cli.host", "main", "run the host cache service: one shared memory tier for this machine's engines"),
    "quarantine": ("kvengine.cli.quarantine", "main",
                   "list or purge a disk tier's namespaces that failed a provenance check"),
    "stats": ("kvengine.cli.stats", "main", "show a running engine's hit rate, tiers and faults (its metrics endpoint)"),
    "top": ("kvengine.cli.top", "main", "watch a running engine's statistics live, with rates per second"),
    "verify": ("kvengine.cli.verify", "main", "prove cached continuations exact on this machine and model; record it"),
}


_EXAMPLES = """\
examples:
  kvengine quickstart                        a store -> lookup -> load round trip
  kvengine demo --size tiny                  multi-turn chat, with and without the cache
  kvengine inspect path/to/config.json       a model's KV spec and what kvengine reuses of it
  kvengine serve --bind 127.0.0.1:7400 --disk /var/kv
                                             a peer server over a disk store
  kvengine host --socket /run/kvengine.sock --capacity 64GiB
                                             one memory tier shared by this machine's engines
  kvengine quarantine list --disk /var/kv    namespaces that failed a provenance check
  kvengine stats --port 9400                 a running engine's statistics (its metrics_port)
  kvengine top --port 9400 --interval 1      the same, live, with rates per second

'kvengine COMMAND --help' describes a command's options.
"""


_LOG_LEVELS = ("debug", "info", "warning", "error")


def _log_level(argv: list[str]) -> tuple[str | None, list[str]]:
    """``--log-level LEVEL`` (or ``--log-level=LEVEL``) before the command, and the arguments after it."""
    if argv and argv[0].startswith("--log-level="):
        return argv[0].split("=", 1)[1], argv[1:]
    if argv and argv[0] == "--log-level":
        return (argv[1] if len(argv) > 1 else ""), argv[2:]
    return None, argv


def _configure_logging(level: str | None) -> None:
    """The command's own logging: lines on stderr (a no-op where the process has handlers already);
    kvengine's loggers at ``level``, else ``KVENGINE_LOG_LEVEL``, else left as they are (warnings)."""
    import logging
    import os

    chosen = level if level is not None else os.environ.get("KVENGINE_LOG_LEVEL")
    if chosen is not None and chosen.lower() not in _LOG_LEVELS:
        print(f"kvengine: --log-level must be one of {', '.join(_LOG_LEVELS)}, got {chosen!r}", file=sys.stderr)
        raise SystemExit(2)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    if chosen is not None:
        logging.getLogger("kvengine").setLevel(chosen.upper())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    level, argv = _log_level(argv)
    _configure_logging(level)
    try:
        return _dispatch(argv)
    except (ConfigError, InvalidRequestError, UnsupportedModelError) as exc:  # the user's input: a usage error
        print(f"kvengine {argv[0] if argv else ''}: {exc}", file=sys.stderr)
        return 2
    except KVEngineError as exc:  # refused or failed, said in one line (a traceback helps nobody here)
        print(f"kvengine {argv[0] if argv else ''}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as exc:  # an optional dependency of this command
        extra = _EXTRAS.get((exc.name or "").partition(".")[0])
        if extra is None:
            raise
        print(f"kvengine {argv[0] if argv else ''}: {exc.name} is not installed; pip install 'kvengine[{extra}]'",
              file=sys.stderr)
        return 2


#: Optional packages the commands import, and the extra that brings each.
_EXTRAS = {"transformers": "hf", "tqdm": "hf", "gguf": "hf", "accelerate": "hf", "zmq": "zmq", "ucxx": "ucx",
           "blosc2": "compression"}


def _dispatch(argv: list[str]) -> int:
    if argv and argv[0] in _DELEGATED:
        module, func, _ = _DELEGATED[argv[0]]
        return int(getattr(importlib.import_module(module), func)(argv[1:]))
    parser = argparse.ArgumentParser(prog="kvengine", description="KV-cache offload engine for LLM inference.",
                                     epilog=_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {kvengine_version()}")
    parser.add_argument("--log-level", choices=_LOG_LEVELS, metavar="LEVEL",
                        help=f"level of kvengine's log lines on stderr, before the command: {', '.join(_LOG_LEVELS)} "
                             "(default: KVENGINE_LOG_LEVEL, else warning)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, _, help_text) in _DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    q = sub.add_parser("quickstart", help="store -> lookup -> load round trip through the Python API",
                       description="Store a random prompt's KV, look it up as a new request, load it back, verify.")
    q.add_argument("--tokens", type=positive_int, default=4000, help="prompt length in tokens (default 4000)")
    q.add_argument("--chunk-size", type=positive_int, default=256, help="tokens per chunk (default 256)")
    q.set_defaults(func=_quickstart)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

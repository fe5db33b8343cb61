"""The proof ``kvengine verify vllm`` runs on the user's machine, model and configuration.

The end-to-end check the test suite runs on the CPU build, with real vLLM
engines in vLLM's default topology (engine core and workers in processes of
their own), one after another:

1. **writer** -- vLLM with the kvengine connector on the configured tiers:
   the prompts below, storing their chunks. The block and chunk sizes come
   from what the worker reports (a hybrid model's attention block is sized in
   vLLM's engine core): where they differ from vLLM's configuration, the
   writer is started once more with the budget and prompts they need; with
   several KV cache groups, once more again on a budget sized from the blocks
   one preempted-size request was measured to hold (:class:`_Plan`);
2. **reader** -- a FRESH engine process with the connector when a persistent
   or shared tier is configured (disk, peers, Mooncake), loading from it, and
   a control with nothing cached (:func:`_control_failure`); memory only: the
   writer engine again;
3. **reference** -- vLLM without the connector, on the CPU cores the
   connector's engines compute on (:func:`_cpus_reserved_as`): greedy tokens
   and their log-probabilities for the same prompts, each computed whole, and each
   request run alone that a pass resumed from cached tokens computed again
   resumed at the same token by vLLM's own prefix cache
   (:func:`_resumed_references`): a prefill split elsewhere rounds
   differently in bf16 on AMX CPUs, by as much as a wrong state moves it.

Prompts (``C`` the chunk size the connector derives from vLLM's blocks):
full and partial chunks (``2.5 C + 1``); a prompt sharing ``1.5 C`` with it;
a first chat turn whose reply completes a chunk while decoding, then the next
turn over that reply (KV computed while decoding, reused); and four prompts
sharing ``2 C`` (nothing with vLLM's prefix cache on) run together on a KV
budget too small for them, so that vLLM preempts them and resumes them by
looking them up again. Every engine, the reference's too, runs on that budget
(``num_gpu_blocks_override``); with several KV cache groups it is sized from
the blocks one such request was measured to hold (:class:`_Plan`). The proof
fails unless vLLM reports preemptions in each of the connector's passes.

Greedy tokens must equal the reference's (the resumed one where there is
one) in the writer and the reader pass, and log-probabilities within
:data:`ALONE_TOLERANCE` of it for a request run alone (the preempted
requests, batched, against the whole prompts:
:data:`~kvengine.trust.proof_run.LOGPROB_TOLERANCE`; not at all where their
outputs follow step timing, see :func:`_preempted_bound`).
Each KV cache group gets a verdict, with the tokens the reader loaded (a
reader that loads nothing fails). vLLM keeps its KV inside the workers, so a
group's state is judged by the outputs it leads to (``max_state_error`` None).
In the connector's passes vLLM's own prefix cache is off, so every reused
token is kvengine's, except for models with a recurrent-state group, which the
connector serves only with it on (vLLM's ``mamba_cache_mode 'align'``).

Must run in a ``__main__``-guarded process (vLLM spawns its engine processes).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import socket
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvengine.config import EngineConfig
from kvengine.errors import InvalidRequestError, UnsupportedModelError
from kvengine.metrics import parse_key, scrape
from kvengine.trust.proof_run import LOGPROB_TOLERANCE, ProofClock, ProofResult
from kvengine.trust.verification import GroupVerdict, Outcome

CONNECTOR_MODULE = "kvengine.integrations.vllm.connector"
#: requests of the preemption pass (run together on a budget that holds about one of them)
PREEMPTED_REQUESTS = 4
FIRST_TURN, NEXT_TURN, PREEMPTION = "first turn", "reply reused on the next turn", "preemption"
#: Largest log-probability difference for a request run alone, as in the reference. Tighter than the bound
#: for the preempted requests (:func:`_preempted_bound`): requests alone stay within 6e-4 (bf16 Qwen3-Next), so
#: a wrong recurrent state cannot hide there.
ALONE_TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 5e-3}
#: EngineArgs the proof sets (``--engine-args`` may not)
PROOF_ARGS = frozenset({"model", "dtype", "tensor_parallel_size", "max_num_seqs", "max_model_len",
                        "num_gpu_blocks_override", "enable_prefix_caching", "kv_transfer_config", "disable_log_stats"})


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmProofSettings:
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    max_new_tokens: int = 16
    max_seconds: float = 900.0
    #: further vLLM ``EngineArgs`` as you serve (e.g. ``compilation_config``), except :data:`PROOF_ARGS`
    engine_args: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        taken = sorted(set(self.engine_args) & PROOF_ARGS)
        if taken:
            raise InvalidRequestError(f"--engine-args: {taken} are set by the proof itself (it sizes the KV budget, "
                                      "the prompts and the connector)")


@dataclass(frozen=True, slots=True)
class _Prompt:
    name: str
    tokens: tuple[tuple[int, ...], ...]  # one batch: these requests are added together
    max_tokens: int
    #: the prompt whose request, prompt and reply, this one's tokens begin with (the next turn's first turn)
    follows: str | None = None


@dataclass(frozen=True, slots=True)
class _Output:
    tokens: list[int]
    logprobs: list[float]
    #: prompt tokens vLLM reported cached when it first scheduled the request (its prefix cache and the connector)
    cached: int = 0


class _SchedulerWatch:
    """A vLLM stat logger keeping what vLLM's scheduler reports: preempted requests (its own count) and,
    while ``recording``, each step's KV cache usage and whether it fed prompt tokens. vLLM builds the
    logger from its class, so the figures live on the class: :func:`_scheduler_watch` makes one per proof."""

    preempted = 0
    recording = False
    #: (KV cache usage, prompt tokens fed) per step while recording
    steps: list[tuple[float, int]] = []

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        pass

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        cls = type(self)
        if iteration_stats is not None:
            cls.preempted += int(iteration_stats.num_preempted_reqs)
        if cls.recording and scheduler_stats is not None and iteration_stats is not None:
            cls.steps.append((float(scheduler_stats.kv_cache_usage), int(iteration_stats.num_prompt_tokens)))

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass


def _scheduler_watch() -> type[_SchedulerWatch]:
    from vllm.v1.metrics.loggers import StatLoggerBase

    return type("SchedulerWatch", (_SchedulerWatch, StatLoggerBase), {"preempted": 0, "steps": []})


def run_proof(model: str, kvengine_source: str | None, config: EngineConfig, requested_chunk: int | None, *,
              settings: VllmProofSettings = VllmProofSettings(),
              progress: Callable[[str], None] = lambda line: None) -> ProofResult:
    """Run the proof (module docstring) for the model directory ``model`` and the kvengine configuration
    ``kvengine_source`` (a YAML path, already validated as ``config``; None: memory only).

    :raises UnsupportedModelError: vLLM or the connector refused the model (the reason said).
    :raises ProofTimedOut: past ``settings.max_seconds``.
    """
    clock = ProofClock(settings.max_seconds, progress)
    clock.step("vLLM configuration (block size, vocabulary)")
    probe = _engine_config(model, settings)
    hybrid = bool(probe.model_config.is_hybrid)
    k, vocab, kinds = settings.max_new_tokens, int(probe.model_config.get_vocab_size()), _layer_kinds(probe)
    plan = _Plan.of(int(probe.cache_config.block_size), requested_chunk, k, kinds)
    fresh = config.disk.path is not None or bool(config.peers.peers or config.peers.peers_file) or \
        config.mooncake.master is not None or bool(config.tiers)
    port = config.metrics_port or _free_port(settings.tensor_parallel_size)
    extra = {"kvengine": {**_raw_config(kvengine_source), "metrics_port": port},
             # the proof is what unlocks a backend not validated in-tree: it runs on it to prove it
             "verification": {"serve_unverified_backend_risking_wrong_outputs": True}}
    base = dict(model=model, dtype=settings.dtype, tensor_parallel_size=settings.tensor_parallel_size,
                enforce_eager=True, seed=0, **settings.engine_args, max_num_seqs=PREEMPTED_REQUESTS,
                enable_prefix_caching=hybrid)

    def plain_args(plan: _Plan) -> dict[str, Any]:
        # the same KV budget with and without the connector: vLLM preempts the reference too, and a resumed
        # request's outputs follow vLLM's own recompute path (bf16 Qwen3-Next: up to 1.2 in log-probability
        # from the request run alone, the same with and without the connector)
        # a hybrid model's block size is resolved in the engine core: set it, so that vLLM 0.32's CPU platform
        # hook does not put the scheduler's back to 128 in the reference (where the connector's _keep_block_size
        # does not run), which would split its prefills elsewhere and move its bf16 outputs by 0.016
        sized = {"block_size": plan.block} if hybrid and plan.block != probe.cache_config.block_size else {}
        return {**base, **sized, "max_model_len": plan.max_len, "num_gpu_blocks_override": plan.budget,
                "disable_log_stats": False}

    def connector_args(plan: _Plan) -> dict[str, Any]:
        return {**plain_args(plan), "kv_transfer_config": {
            "kv_connector": "KVEngineConnector", "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}}

    watch = _scheduler_watch()
    got: dict[str, dict[str, list[_Output]]] = {}
    with contextlib.ExitStack() as stack:
        for attempt in range(3):
            clock.step(f"writer: vLLM with the kvengine connector, KV budget {plan.budget} blocks of {plan.block}")
            engine = stack.enter_context(_engine(connector_args(plan), watch))
            labels, metrics = _platform_labels(port), scrape(port)
            block, chunk = _block_size(metrics), int(metrics.get("kvengine_vllm_chunk_tokens", 0))
            if (block, chunk) != (plan.block, plan.chunk):
                if attempt:
                    raise UnsupportedModelError(f"the connector's blocks ({block}) and chunks ({chunk}) changed "
                                                "between two starts of the same engine")
                # a hybrid model's attention block is sized in the engine core to hold its state page
                following = _Plan.of(block, chunk, k, kinds)
            elif not plan.calibrated:
                # several KV cache groups share the block pool in shares only vLLM's allocator knows
                measured = _measure(engine, watch, plan, clock, vocab)
                following = plan.calibrate(*measured)
                clock.step("one preempted-size request held {} blocks prefilling, {} decoding, {} more a block: "
                           "a budget of {} blocks, {} boundaries past the first".format(
                               *measured, following.budget, following.boundaries))
            else:
                break
            # nothing was compared yet: start again with the budget and prompts the proof needs
            stack.close()
            plan = following
        connector_config = engine.vllm_config  # what the reference matches the CPU cores of
        prompts = _prompts(plan, k, vocab, hybrid)
        desc = ", ".join(f"{p.name} ({'+'.join(str(len(t)) for t in p.tokens)} tokens)" for p in prompts)
        clock.step(f"block size {plan.block}, chunk {plan.chunk}{', prefix caching on (hybrid)' if hybrid else ''}; "
                   f"prompts: {desc}")
        got["writer"] = {}
        for i, p in enumerate(prompts):
            if p.name == NEXT_TURN:  # the next turn over the first turn's reply (checked against the reference)
                prompts[i] = p = _with_reply(p, got["writer"][FIRST_TURN][0].tokens, k)
            got["writer"][p.name] = _run(engine, p, clock, "writer")
        preempted = {"writer": watch.preempted}
        if not fresh:
            clock.step("reader (memory only: the writer engine again)")
            before = scrape(port)
            got["reader"] = {p.name: _run(engine, p, clock, "reader") for p in prompts}
            after = scrape(port)
    control: list[_Output] = []
    if fresh:
        clock.step("reader: a fresh engine process with the connector, loading from the configured tiers")
        with _engine(connector_args(plan), watch) as engine:
            before = scrape(port)
            got["reader"] = {p.name: _run(engine, p, clock, "reader") for p in prompts}
            after = scrape(port)
            # the control: a request with nothing cached (the writer's first one had none either)
            control = _run(engine, prompts[0], clock, "reader control, nothing cached", salted=True)
    preempted["reader"] = watch.preempted - preempted["writer"]  # the reference engine has no watch
    clock.step("reference: vLLM without the connector, each prompt whole and resumed where the passes resumed it")
    with _cpus_reserved_as(connector_config), \
            _engine({**plain_args(plan), "enable_prefix_caching": True}) as engine:
        want = {p.name: _run(engine, p, clock, "reference", whole=True) for p in prompts}
        resumed = _resumed_references(engine, prompts, got, clock)
    # each request run alone against its nearest reference resumed where it was, else the whole prompt's
    expected = {which: {name: [min(resumed.get((which, name), [w]), key=lambda r: _error([o], [r]))
                               for o, w in zip(outputs, want[name])] for name, outputs in passes.items()}
                for which, passes in got.items()}
    dtype = str(probe.model_config.dtype).removeprefix("torch.")
    if dtype not in LOGPROB_TOLERANCE:
        raise UnsupportedModelError(f"kvengine verify vllm: no tolerance is established for {dtype} "
                                    f"(known: {', '.join(LOGPROB_TOLERANCE)})")
    # how far this platform's outputs move with where a prefill is split: a resumed reference from its whole one
    split_effect = max((_error([ref], want[name]) for (_, name), refs in resumed.items() for ref in refs),
                       default=0.0)
    preempted_bound = _preempted_bound(dtype, hybrid, split_effect)
    unjudged = {PREEMPTION} if preempted_bound == math.inf else set()
    if unjudged:
        clock.step(f"preempted requests not judged: they are resumed where step timing puts them, and this model "
                   f"{'has recurrent state' if hybrid else f'moves by {split_effect:.3g} with a split prefill'} "
                   f"in {dtype}")
    failures = [f for which, outputs in got.items() for f in _differences(which, outputs, expected[which], unjudged)]
    if control:
        (cold,) = want[prompts[0].name]
        clock.step(f"reader control ({control[0].cached} tokens cached) against the reference: "
                   f"{_error(control, [cold]):.3g}")
        failures[:0] = _control_failure(prompts[0].name, control[0], cold, ALONE_TOLERANCE[dtype])
    loaded = int(_delta(after, before, "kvengine_loaded_tokens_total"))
    failed = int(_delta(after, before, "kvengine_load_failed_tokens_total"))
    clock.step(f"reader loaded {loaded} tokens ({failed} failed and recomputed); vLLM preempted "
               f"{preempted['writer']} requests in the writer pass, {preempted['reader']} in the reader's")
    if loaded == 0:
        failures.append(f"loaded nothing: the reader pass reused no token (chunk size {plan.chunk})")
    failures += [f"vLLM preempted no request in the {which} pass on a budget of {plan.budget} blocks: the "
                 "preemption case was not exercised" for which, n in preempted.items() if n == 0]
    errors = {(which, name): _error(out, expected[which][name]) for which, outputs in got.items()
              for name, out in outputs.items()}
    clock.step(f"log-probability error against the reference ({len(resumed)} resumed where the passes resumed): "
               + ", ".join(f"{which} {name} {e:.3g}" for (which, name), e in errors.items()))
    for (which, name), e in errors.items():
        bound = preempted_bound if name == PREEMPTION else ALONE_TOLERANCE[dtype]
        if e > bound and not failures:
            failures.append(f"{which} pass, {name}: log-probabilities differ by up to {e:.3g} (tolerance {bound:g} "
                            f"for {dtype}{' batched' if name == PREEMPTION else ''})")
    error = max(e for (_, name), e in errors.items() if name not in unjudged)
    exact = not failures
    groups = tuple(GroupVerdict(group=g, outcome=Outcome.EXACT if exact else Outcome.DIFFERS, max_state_error=None,
                                max_logprob_error=error, max_logit_error=None, tokens_loaded=loaded)
                   for g in _groups(metrics))
    from .acceptance import platform_from_labels

    platform, fingerprint = platform_from_labels(labels)
    return ProofResult(model=model, model_fingerprint=fingerprint, platform=platform, groups=groups,
                       tokens_loaded=loaded, failure="; ".join(failures) or None)


@dataclass(frozen=True, slots=True)
class _Plan:
    """Block and chunk sizes, and what follows from them: the KV budget of the connector engines, how far
    the preempted requests decode, and the longest sequence the engines take.

    Preempted requests have prompts of ``m`` blocks less a token (``m`` more than any other request needs),
    so each asks for a block more on its third decoded token, and again every block after.

    One KV cache group: the budget, ``2m + 1`` blocks (vLLM keeps one null block), admits two of them and
    leaves none, so at that first boundary vLLM preempts one.

    Several groups share vLLM's one block pool, and a request's share of it is not ``m`` per group: a
    sliding window or a recurrent state (``mamba_cache_mode 'align'``) holds fewer blocks, some only while
    prefilling. So the first plan's budget holds one request, whose use of it is measured
    (:func:`_measure`), and :meth:`calibrate` sizes the budget and decode from that."""

    block: int
    chunk: int
    per_request: int  # m
    budget: int
    #: block boundaries the preempted requests cross after their first (vLLM preempts at the last at the latest)
    boundaries: int
    #: tokens they decode past it: what a preempted request computes once resumed over the loaded KV
    after: int
    #: the budget is known to preempt (one group), or was sized from measured usage
    calibrated: bool = field(default=False, kw_only=True)

    @classmethod
    def of(cls, block: int, chunk: int | None, k: int, kinds: int) -> _Plan:
        """``chunk`` None: the connector's "auto" (``layout.resolve_chunk_size``) for one block size."""
        chunk = chunk or block * -(-256 // block)
        m = -(-(2 * chunk + chunk // 2 + 1 + 2 * k) // block) + 1
        # several groups: a budget for one request at least, and a block's decode to measure it (calibrate)
        return cls(block, chunk, m, (2 * m + 1) * kinds, 0 if kinds == 1 else 1, k, calibrated=kinds == 1)

    @property
    def decode(self) -> int:
        """Tokens each preempted request decodes: through its last boundary, then :attr:`after` more."""
        return 2 + self.boundaries * self.block + self.after

    @property
    def max_len(self) -> int:
        """The longest sequence: a preempted request's (in whole blocks; the others' are shorter)."""
        return -(-(self.per_request * self.block - 1 + self.decode) // self.block) * self.block

    def calibrate(self, peak: int, settled: int, growth: int) -> _Plan:
        """The plan for preempted requests measured alone (blocks in use, :func:`_measure`): ``peak`` while
        prefilling, ``settled`` once decoding, and ``growth`` at each block boundary. With ``n`` of them
        (:data:`PREEMPTED_REQUESTS`), vLLM may admit the last only once the others have crossed their first
        boundary (added one by one, the first is decoding before the others arrive), so the budget is
        ``(n - 1) (settled + growth) + peak`` blocks (and vLLM's null block). All of them past that boundary
        leave ``peak - settled - growth`` blocks, which they outgrow within ``j = (peak - settled - growth)
        // (n growth) + 1`` boundaries more (none where that is negative: the first overflows it). Admitted
        earlier, they cross the first boundary together and reach the same point."""
        if growth <= 0 or settled <= 0 or peak < settled:
            raise UnsupportedModelError(f"cannot size a KV budget that preempts: one request held {peak} blocks "
                                        f"prefilling, {settled} decoding, and grew by {growth} per block decoded")
        n = PREEMPTED_REQUESTS
        grown = settled + growth
        boundaries = max(0, (peak - grown) // (n * growth) + 1)
        return _Plan(self.block, self.chunk, self.per_request, (n - 1) * grown + peak + 1, boundaries, self.after,
                     calibrated=True)


def _measure(engine: Any, watch: type[_SchedulerWatch], plan: _Plan, clock: ProofClock,
             vocab: int) -> tuple[int, int, int]:
    """Blocks one preempted-size request holds alone (see :meth:`_Plan.calibrate`): at its peak while
    prefilling, once decoding, and its growth over a block decoded; from the KV cache usage vLLM reports
    after each step (a step's report follows its frees: the finishing step shows none), on a fresh prompt
    (no hit, nothing shared in vLLM's prefix cache)."""
    rng = random.Random(4321)
    tokens = tuple(rng.randrange(3, min(vocab, 32000)) for _ in range(plan.per_request * plan.block - 1))
    watch.steps, watch.recording = [], True
    try:
        _run(engine, _Prompt("budget calibration", (tokens,), plan.block + 2), clock, "writer")
    finally:
        watch.recording = False
    used = [round(usage * (plan.budget - 1)) for usage, _ in watch.steps]  # vLLM's null block is not counted
    prefilled = next((i for i, (_, prompt) in enumerate(watch.steps) if prompt), None)
    if prefilled is None or len(used) < prefilled + 3:
        raise UnsupportedModelError("vLLM reported no KV cache usage per step: cannot size the preemption budget")
    settled = min(used[prefilled + 1: -1])  # once vLLM retired what only the prefill needed
    return max(used[: prefilled + 1]), settled, used[-2] - settled


def _prompts(plan: _Plan, k: int, vocab: int, prefix_cached: bool) -> list[_Prompt]:
    """The proof's prompts (module docs). With vLLM's prefix cache on (``prefix_cached``: hybrid models) the
    preempted requests share no prefix: vLLM would hold its blocks once, and the measured budget
    (:meth:`_Plan.calibrate`) is per request; they hit on resuming, in their own chunks."""
    rng = random.Random(1234)
    top = min(vocab, 32000)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(3, top) for _ in range(n)]

    chunk = plan.chunk
    first = fresh(2 * chunk + chunk // 2 + 1)
    shared = first[: chunk + chunk // 2] + fresh(chunk // 2 + chunk // 4 + 3)
    turn1 = fresh(2 * chunk - k // 2)  # its reply completes the second chunk while decoding
    preempted = plan.per_request * plan.block - 1
    common = 0 if prefix_cached else 2 * chunk
    preempt = tuple(tuple(first[:common] + fresh(preempted - common)) for _ in range(PREEMPTED_REQUESTS))
    return [_Prompt("full and partial chunks", (tuple(first),), k),
            _Prompt("shared prefix", (tuple(shared),), k),
            _Prompt(FIRST_TURN, (tuple(turn1),), k),
            _Prompt(PREEMPTION, preempt, plan.decode),
            # the next turn over the first turn's reply: its tokens are filled in from the writer's reply
            _Prompt(NEXT_TURN, (tuple(turn1) + (0,) * k + tuple(fresh(7)),), k, follows=FIRST_TURN)]


def _with_reply(prompt: _Prompt, reply: list[int], k: int) -> _Prompt:
    """:data:`NEXT_TURN` with the first turn's reply in place."""
    (tokens,) = prompt.tokens
    head = len(tokens) - k - 7
    return _Prompt(prompt.name, (tokens[:head] + tuple(reply) + tokens[head + k:],), prompt.max_tokens,
                   prompt.follows)


def _run(engine: Any, prompt: _Prompt, clock: ProofClock, which: str, *, whole: bool = False,
         salted: bool = False) -> list[_Output]:
    """Greedy tokens and their log-probabilities for ``prompt``'s requests, added together. ``whole``: each
    computed from its first token (vLLM's prefix cache emptied first, and requests added together salted
    apart, so that they share no block, as with the prefix cache off). ``salted``: each request salted apart
    from every other (no hit in vLLM's prefix cache or in the connector's tiers)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    clock.step(f"{which}: {prompt.name}")
    if whole:
        _empty_prefix_cache(engine)
    sp = SamplingParams(max_tokens=prompt.max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    ids = [f"{which}-{prompt.name}-{i}" for i in range(len(prompt.tokens))]
    for rid, tokens in zip(ids, prompt.tokens):
        salt = {"cache_salt": rid} if salted or (whole and len(prompt.tokens) > 1) else {}
        engine.add_request(rid, TokensPrompt(prompt_token_ids=list(tokens), **salt), sp)
    done: dict[str, _Output] = {}
    while engine.has_unfinished_requests():
        clock.check(f"{which}: {prompt.name}")
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = _Output(list(c.token_ids),
                                               [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])],
                                               int(out.num_cached_tokens or 0))
    return [done[rid] for rid in ids]


def _resumed_references(engine: Any, prompts: list[_Prompt], got: Mapping[str, Mapping[str, list[_Output]]],
                        clock: ProofClock) -> dict[tuple[str, str], list[_Output]]:
    """The references for each request run alone that a pass resumed from cached tokens, keyed by pass and
    prompt name: vLLM (prefix cache on, no connector) resuming it at the same token over KV computed in each
    way the pass may have computed it.

    A request resumed from cached pages runs over KV computed otherwise than in its whole prompt's prefill:
    its prefill is split there, and a reply's KV was computed while decoding it (one token a step), by a
    request itself resumed somewhere. Where vLLM's kernels round differently for those (bf16 on AMX CPUs:
    0.015 in log-probability, as far as a wrong state moves them; measured 2026-12-07 on DeepSeek-V2 and
    Qwen3-Next), only a reference computed the same way can tell a right hit from a wrong one. Which way is
    the store's business (the chunk of a reply re-stored by a later request of the pass, a recurrent state
    only where a prefill materialized one), so there are two, each its prefix cache emptied first:

    * prefilled: the prompt's first ``c + 1`` tokens (a recurrent state is materialized at the last block
      boundary before a prompt's end), then the prompt;
    * decoded: the prompt it follows (the next turn's first turn) run again, resumed where that pass
      resumed it (its reply decoded again), then as prefilled.

    A request vLLM does not resume at ``c`` there (``c`` not a block boundary) gets no reference that way."""
    named = {p.name: p for p in prompts}
    computed: dict[tuple[tuple[str, int], ...], _Output | None] = {}
    out: dict[tuple[str, str], list[_Output]] = {}
    for which, passes in got.items():
        for p in prompts:
            cached = passes[p.name][0].cached
            if len(p.tokens) != 1 or not cached:
                continue
            ways: list[tuple[tuple[str, int], ...]] = [((p.name, cached),)]
            if p.follows:
                ways.append(((p.follows, passes[p.follows][0].cached), (p.name, cached)))
            for steps in ways:
                if steps not in computed:
                    _empty_prefix_cache(engine)
                    ref = None
                    for name, at in steps:
                        ref = _resumed_at(engine, named[name], at, clock)
                        if ref is None:
                            break
                    computed[steps] = ref
            refs = [ref for ref in (computed[steps] for steps in ways) if ref is not None]
            if refs:
                out[(which, p.name)] = refs
    return out


def _resumed_at(engine: Any, prompt: _Prompt, cached: int, clock: ProofClock) -> _Output | None:
    """``prompt`` run by vLLM resuming it at token ``cached`` (None where it resumed elsewhere)."""
    (tokens,) = prompt.tokens
    if cached:
        _run(engine, _Prompt(f"{prompt.name}, its first {cached + 1} tokens", (tokens[:cached + 1],), 1), clock,
             "reference")
    (ref,) = _run(engine, prompt, clock, f"reference resumed at {cached}")
    if ref.cached != cached:
        clock.step(f"reference: vLLM resumed {prompt.name} at {ref.cached}, not {cached}: no reference that way")
        return None
    return ref


def _empty_prefix_cache(engine: Any) -> None:
    if not engine.reset_prefix_cache():
        raise UnsupportedModelError("vLLM could not empty its prefix cache for the reference (blocks in use)")


def _error(outputs: list[_Output], references: list[_Output]) -> float:
    """The largest log-probability difference between ``outputs`` and their references."""
    return max((abs(a - b) for o, w in zip(outputs, references) for a, b in zip(o.logprobs, w.logprobs)),
               default=math.inf)


def _control_failure(name: str, control: _Output, reference: _Output, tolerance: float) -> list[str]:
    """The reader engine's control (``name`` with nothing cached) against the reference's: off by more than
    ``tolerance``, or a greedy token apart, the platform's outputs differ between engine starts, and the
    reader's hits cannot be judged against the reference (a failure naming the platform, not the cache)."""
    drift = _error([control], [reference])
    if drift <= tolerance and control.tokens == reference.tokens:
        return []
    return [f"the fresh reader engine computed {name} with nothing cached {drift:.3g} from the reference engine "
            f"(greedy tokens {'equal' if control.tokens == reference.tokens else 'differ'}): outputs on this "
            "platform differ from one engine start to another, so no hit can be judged against them"]


def _preempted_bound(dtype: str, hybrid: bool, split_effect: float) -> float:
    """The log-probability bound for the preempted requests: the dtype's, except where their outputs follow
    step timing, where they are not judged (no bound, and their greedy tokens are not compared either: a
    resumed bf16 request flipped a token in 1 of 2 CI runs, 2026-12-06): a model with recurrent state below
    fp32, and a platform whose outputs move past :data:`ALONE_TOLERANCE` with where a prefill is split
    (``split_effect``, measured by the proof: bf16 DeepSeek-V2 on an AMX Xeon, 0.015; there a preempted
    request resumed from a chunk stored a step earlier or later flipped a greedy token and moved by 0.35,
    2026-12-07, while every request run alone equalled its resumed reference bit for bit).

    vLLM resumes a preempted hybrid request from the state at a block boundary and recomputes the rest, so its
    outputs follow where it resumed, which follows step timing (asynchronous loads and saves): in bf16,
    Qwen3-Next's preempted requests moved by up to 1.19 without the connector against the same requests run
    alone, and by 1.93 in 4 of 6 proofs against the reference (2026-12-06, tokens identical). A bound there
    refuses at random, and proves nothing a bound can: reading the state from the wrong block moves outputs by
    0.015 (docs/vllm.md, Gaps), below the dtype's bound already. The requests run alone, held to
    :data:`ALONE_TOLERANCE`, are where a wrong state shows."""
    if (hybrid and dtype != "float32") or split_effect > ALONE_TOLERANCE[dtype]:
        return math.inf
    return LOGPROB_TOLERANCE[dtype]


def _differences(which: str, got: dict[str, list[_Output]], want: dict[str, list[_Output]],
                 unjudged: Collection[str] = ()) -> list[str]:
    """The first greedy difference of each prompt against the reference (the sections in ``unjudged`` aside)."""
    out = []
    for name, outputs in got.items():
        if name in unjudged:
            continue
        for i, (o, w) in enumerate(zip(outputs, want[name])):
            if o.tokens != w.tokens:
                step = next((j for j, (a, b) in enumerate(zip(o.tokens, w.tokens)) if a != b),
                            min(len(o.tokens), len(w.tokens)))
                out.append(f"{which} pass, {name} (request {i}): greedy token {step} differs from vLLM without "
                           "the connector")
                break
    return out


def _layer_kinds(vllm_config: Any) -> int:
    """How many kinds of layers the model declares (``layer_types``: vLLM makes one KV cache group per kind)."""
    kinds = getattr(vllm_config.model_config.hf_text_config, "layer_types", None) or ()
    return max(1, len(set(kinds)))


def _engine_config(model: str, settings: VllmProofSettings) -> Any:
    """vLLM's configuration for the model (block size chosen for this platform, hybrid or not), no engine."""
    from vllm import EngineArgs

    return EngineArgs(**{"enforce_eager": True, **settings.engine_args}, model=model, dtype=settings.dtype,
                      tensor_parallel_size=settings.tensor_parallel_size).create_engine_config()


@contextlib.contextmanager
def _engine(args: dict[str, Any], watch: type[_SchedulerWatch] | None = None) -> Iterator[Any]:
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine.from_engine_args(EngineArgs(**args), stat_loggers=[watch] if watch else None)
    except Exception as exc:  # vLLM surfaces the connector's refusal as its own start-up failure
        raise UnsupportedModelError(f"vLLM did not start: {type(exc).__name__}: {exc}") from exc
    try:
        yield engine
    finally:
        engine.engine_core.shutdown()


@contextlib.contextmanager
def _cpus_reserved_as(vllm_config: Any) -> Iterator[None]:
    """Start engines within on the CPU cores an engine of ``vllm_config`` computes on.

    vLLM's CPU platform reserves a core more for an engine with a KV connector, and the worker's OpenMP
    threads take the cores left (2-core machine: 2 threads with the connector, 1 without). A GEMM's sums are
    split by thread, so the reference would round differently from the connector's engines (bf16 Qwen3-Next
    on an AMX Xeon: 4.3e-4 apart on the same cold prompt, and a greedy token flipped; measured 2026-12-07).
    vLLM's own count for that configuration is set for the engines within."""
    try:
        from vllm.utils.ompmultiprocessing import OMPProcessManager
    except ImportError:  # a vLLM release without it: nothing to match
        yield
        return
    # off the CPU platform the manager's constructor sets nothing: nothing to match either
    reserved = getattr(OMPProcessManager(vllm_config), "reserve_cpu_num", None)
    if reserved is None:
        yield
        return
    name, before = "VLLM_CPU_NUM_OF_RESERVED_CPU", os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU")
    os.environ[name] = str(reserved)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _raw_config(source: str | None) -> dict[str, Any]:
    if source is None:
        return {"memory": {"capacity_bytes": "256MiB"}}
    return dict(yaml.safe_load(Path(source).read_text()) or {})


def _free_port(count: int) -> int:
    """A port with ``count - 1`` free ones after it (one metrics port per tensor-parallel rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + count < 65536 and all(_port_free(port + i) for i in range(1, count)):
            return port
    raise OSError("no free metrics port")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _platform_labels(port: int) -> dict[str, str]:
    for key in scrape(port):
        name, labels = parse_key(key)
        if name == "kvengine_vllm_platform_info":
            return labels
    raise UnsupportedModelError("the kvengine worker published no kvengine_vllm_platform_info")


def _block_size(metrics: dict[str, float]) -> int:
    """The largest block size the worker reported over its KV cache groups."""
    sizes = [int(v) for key, v in metrics.items() if parse_key(key)[0] == "kvengine_vllm_block_tokens"
             and "group" in parse_key(key)[1]]
    if not sizes:
        raise UnsupportedModelError("the kvengine worker reported no KV cache group (kvengine_vllm_block_tokens)")
    return max(sizes)


def _groups(metrics: dict[str, float]) -> list[str]:
    """``group N (kind)`` for every KV cache group the worker reported."""
    groups = {}
    for key in metrics:
        name, labels = parse_key(key)
        if name == "kvengine_vllm_block_tokens" and "group" in labels:
            groups[int(labels["group"])] = f"group {labels['group']} ({labels['kind']})"
    return [groups[g] for g in sorted(groups)]


def _delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


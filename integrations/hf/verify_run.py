"""The proof ``kvengine verify hf`` runs on the user's machine, model and configuration.

Not the attach canary (:mod:`.verify`, which runs inside every attach); this is
the end-to-end check the test suite runs, for one real model:

1. plain transformers (no kvengine): greedy outputs of three prompts -- full
   and partial chunks; a prompt sharing a prefix with the first; the first
   prompt + its reply + new user tokens (a reply reused on the next turn);
2. a writer pass: kvengine's :meth:`~.generator.AttachedModel.generate` over
   those prompts, storing their chunks in the configured tiers, and the first
   prompt preempted halfway through its reply and resumed by a new request
   (there is no scheduler: its cache is dropped, the resumed request looks up
   the prompt and the tokens generated so far);
3. a reader pass on a FRESH engine and attach when a disk tier is configured
   (the load path from the persistent tier is exercised; memory only: the
   same engine): generate again, then per prompt the loaded KV and the
   per-step log-probabilities of the reply over it, against a plain run split
   at the same boundaries.

Greedy tokens must be identical. Each KV layer group is EXACT when its loaded
state and the log-probabilities are within :data:`TOLERANCE` of the plain run
(0 is what an exact path measures for KV computed in prefill; KV computed
while decoding was rounded by other kernel shapes) and tokens were loaded; a
reader pass that loads nothing fails, and so does a group whose restored state was never compared.
``max_seconds`` is checked between steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvengine.errors import UnsupportedModelError
from kvengine.facade import KVEngine
from kvengine.trust.proof_run import LOGPROB_TOLERANCE, ProofClock, ProofResult
from kvengine.trust.verification import GroupVerdict, Outcome, Platform

from .attaching import attach
from .generator import AttachedModel
from .proof import probe_tokens
from .verify import plain_run

#: The first prompt again, preempted halfway through its reply and resumed (:func:`_generate_pass`).
PREEMPTED = "preempted and resumed"
#: Largest accepted error per KV dtype: absolute on log-probabilities, relative to the largest magnitude
#: of the plain run's tensor for the loaded state.
TOLERANCE = {getattr(torch, name): tol for name, tol in LOGPROB_TOLERANCE.items()}


@dataclass(frozen=True, slots=True, kw_only=True)
class ProofSettings:
    max_new_tokens: int = 8
    #: length of the first prompt (None: 2.5 chunks + 1, covering full and partial chunks)
    prompt_tokens: int | None = None
    max_seconds: float = 240.0


def hf_platform(attached: AttachedModel) -> Platform:
    """The :class:`Platform` an attached transformers model runs on."""
    import transformers

    return Platform.on_host(
        attached.runner.device.type, engine="hf", engine_version=transformers.__version__,
        attention_backend=getattr(attached.model.config, "_attn_implementation", None),
        kv_dtype=str(attached.model.dtype).removeprefix("torch."), kv_layout_id=attached.layout.fingerprint,
        block_size=attached.chunk_size, tensor_parallel_size=1)


def plain_greedy(model: Any, ids: torch.Tensor, n: int) -> list[int]:
    """``n`` greedy tokens after ``ids`` through plain transformers (the model's own cache)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model.generate(ids[None].to(device), attention_mask=torch.ones(1, len(ids), dtype=torch.long,
                                                                             device=device),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None)
    return [int(t) for t in out[0, len(ids):]]


def run_proof(model: Any, make_engine: Callable[[], KVEngine], *, fresh_reader: bool, model_id: str,
              settings: ProofSettings = ProofSettings(),
              progress: Callable[[str], None] = lambda line: None) -> ProofResult:
    """Run the proof (module docstring). The engines ``make_engine`` builds are closed here.

    :raises UnsupportedModelError: the model is refused at attach, or is encoder-decoder (not covered yet).
    :raises AttachError: the attach canary refused the model.
    :raises ProofTimedOut: past ``settings.max_seconds``.
    """
    clock = ProofClock(settings.max_seconds, progress)
    k = settings.max_new_tokens
    engine = make_engine()
    # Both sides decode greedily under a neutral generation config: the proof is about the reused KV, and a
    # checkpoint's repetition_penalty (which kvengine's loop refuses) would otherwise stop it.
    saved_config = getattr(model, "generation_config", None)
    if saved_config is not None:
        model.generation_config = _neutral(saved_config)
    try:
        clock.step("attach (derive the KV spec, run the attach canary)")
        attached = attach(model, engine, model_id=model_id)
        if attached.spec.encoder_decoder:
            raise UnsupportedModelError(f"{attached.spec.model_type}: kvengine verify hf covers decoder-only "
                                        "models; encoder-decoder models are proven by the attach canary only")
        c = attached.chunk_size
        n = settings.prompt_tokens or 2 * c + c // 2 + 1
        first = probe_tokens(model, n, seed=11)
        shared = torch.cat([first[: n // 2], probe_tokens(model, n - n // 2, seed=12)])
        clock.step(f"plain transformers: greedy {k} tokens after a {n}-token prompt")
        reply = plain_greedy(model, first, k)
        turn2 = torch.cat([first, torch.tensor(reply), probe_tokens(model, 7, seed=13)])
        prompts = {"full and partial chunks": first, "shared prefix": shared, "reply reused on the next turn": turn2}
        want = {"full and partial chunks": reply}
        for name in list(prompts)[1:]:
            clock.step(f"plain transformers: greedy {k} tokens, {name} ({len(prompts[name])} tokens)")
            want[name] = plain_greedy(model, prompts[name], k)
        failure = _generate_pass(attached, prompts, want, k, clock, "writer")[1]
        if fresh_reader:
            clock.step("fresh engine and attach, reading from the configured persistent tiers")
            engine.close()
            engine = make_engine()
            attached = attach(model, engine, model_id=model_id)
        loaded, reader_failure = _generate_pass(attached, prompts, want, k, clock, "reader")
        failure = failure or reader_failure
        groups = _measure(attached, prompts, want, clock)
        if failure is None and loaded == 0:
            failure = (f"loaded nothing: the reader pass reused no token (chunk size {c}; prompts of "
                       f"{', '.join(str(len(p)) for p in prompts.values())} tokens)")
        if failure is None and any(g.outcome is not Outcome.EXACT for g in groups):
            failure = "layer groups differ: " + ", ".join(g.group for g in groups if g.outcome is not Outcome.EXACT)
        return ProofResult(model=model_id, model_fingerprint=attached.namespace.model_fingerprint,
                           platform=hf_platform(attached), groups=groups, tokens_loaded=loaded, failure=failure)
    finally:
        engine.close()
        if saved_config is not None:
            model.generation_config = saved_config


def _neutral(config: Any) -> Any:
    """A generation config with only the special token ids of ``config``: greedy, no logits processors."""
    from transformers import GenerationConfig

    ids = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
    return GenerationConfig(**{name: getattr(config, name) for name in ids if getattr(config, name, None) is not None})


def _generate_pass(attached: AttachedModel, prompts: dict[str, torch.Tensor], want: dict[str, list[int]], k: int,
                   clock: ProofClock, which: str) -> tuple[int, str | None]:
    """kvengine's generate over every prompt, and the first prompt once more preempted halfway (its cache
    dropped after ``k // 2`` tokens and resumed by a new request over the prompt and those tokens, as a
    scheduler resumes a preempted request): (tokens reused, the first greedy difference or None)."""
    reused, failure = 0, None
    first = next(iter(prompts))
    runs = [(name, ids, k) for name, ids in prompts.items()] + [(PREEMPTED, prompts[first], k // 2)]
    want = {**want, PREEMPTED: want[first]}
    for name, ids, n in runs:
        clock.step(f"{which} pass: kvengine generate, {name}")
        out = attached.generate(ids, max_new_tokens=n, eos_token_id=None)
        got = list(out.new_tokens)
        reused += out.reused_tokens
        if name == PREEMPTED:
            clock.step(f"{which} pass: {name}: dropped after {n} tokens, resumed over the prompt and them")
            rest = attached.generate(torch.cat([ids, torch.tensor(got, dtype=ids.dtype)]), max_new_tokens=k - n,
                                     eos_token_id=None)
            got += list(rest.new_tokens)
            reused += rest.reused_tokens
            out = rest
        clock.step(f"{which} pass: {name}: reused {out.reused_tokens} of {len(ids)} tokens, load ok {out.load_ok}")
        if got != want[name] and failure is None:
            step = next(i for i, (a, b) in enumerate(zip(got, want[name])) if a != b)
            failure = f"{which} pass, {name}: greedy token {step} is {got[step]}, plain transformers {want[name][step]}"
    return reused, failure


def _measure(attached: AttachedModel, prompts: dict[str, torch.Tensor], want: dict[str, list[int]],
             clock: ProofClock) -> tuple[GroupVerdict, ...]:
    """Per KV layer group: the loaded state and the reply's log-probabilities against a plain run."""
    spec, codec, runner = attached.spec, attached.codec, attached.runner
    if attached.model.dtype not in TOLERANCE:
        raise UnsupportedModelError(f"kvengine verify hf: no tolerance is established for {attached.model.dtype} "
                                    f"(known: {', '.join(str(d) for d in TOLERANCE)})")
    tol = TOLERANCE[attached.model.dtype]
    # None until a restored state of the group was compared: a group never compared is not EXACT.
    state_err: dict[str, float | None] = {g.name: None for g in spec.chunk_groups}
    logprob_err = logit_err = 0.0
    compared = 0  # tokens whose restored KV was compared (a restore covers every group alike)
    for name, ids in prompts.items():
        clock.step(f"reader pass: log-probabilities and loaded KV, {name}")
        seq = torch.cat([ids, torch.tensor(want[name])])
        ctx = attached.context()
        restored, matched, _ = attached.restore(ctx, ids, f"kvengine-verify-{name}")
        prefix = attached.prefill_pieces(0, matched, snapshots=True)
        if matched:
            compared += matched
            plain_cache, _ = plain_run(attached.model, ids[:matched], prefix, cache_kw=runner.cache_kw)
            want_states, got_states = codec.comparable(plain_cache), codec.comparable(restored)
            for key, tensors in want_states.items():
                group = spec.group_of(*key).name
                err = _state_error(tensors, got_states.get(key), tol)
                seen = state_err.get(group)
                state_err[group] = err if seen is None else max(seen, err)
        cached = runner.forward(seq[matched:-1], restored, matched, all_logits=True)
        _, plain = plain_run(attached.model, seq[:-1], [*prefix, (matched, len(seq) - 1)], cache_kw=runner.cache_kw)
        rows = slice(len(ids) - 1 - matched, None)
        a, b = cached[rows].double().cpu(), plain[rows].double().cpu()
        logit_err = max(logit_err, float((a - b).abs().max()))
        logprob_err = max(logprob_err, float((a.log_softmax(-1) - b.log_softmax(-1)).abs().max()))
    return tuple(
        GroupVerdict(group=g, outcome=Outcome.EXACT if err is not None and err <= tol and logprob_err <= tol
                     and compared > 0 else Outcome.DIFFERS,
                     max_state_error=float("inf") if err is None else err, max_logprob_error=logprob_err,
                     max_logit_error=logit_err, tokens_loaded=compared)
        for g, err in state_err.items())


def _state_error(want: Any, got: Any, tol: float) -> float:
    """Largest error of ``got`` against ``want``, relative to each tensor's largest magnitude (inf: a
    different shape or a missing state)."""
    if got is None or len(got) != len(want):
        return float("inf")
    worst = 0.0
    for w, g in zip(want, got):
        if w.shape != g.shape:
            return float("inf")
        if not w.numel():
            continue
        diff = float((w.double().cpu() - g.double().cpu()).abs().max())
        scale = float(w.double().abs().max()) if w.is_floating_point() else 1.0
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst

"""``kvengine inspect <model dir | config.json>``: what kvengine would store for a model.

Reads the configuration only (no weights). Prints, per layer group, the
category, bytes per token and per chunk boundary, the reuse plan and the
storage per 1k tokens, then one verdict per integration (HF generate loop,
vLLM connector, SGLang HiCache backend: supported, refused with the reason,
or checked at start-up with what is checked). A model kvengine refuses is
printed with its reason and the command exits 1; a user error (no such
file, malformed config, unknown ``model_type``, unsupported ``--dtype``) is
one line on stderr and exit status 2. ``--json`` prints the same as JSON;
``--list-refused`` lists every refused family and feature with its reason.
"""

from __future__ import annotations

import enum
import json
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvengine.cli.arguments import EXIT_USAGE, OneLineParser, one_line
from kvengine.errors import KVEngineError, UnsupportedModelError

if TYPE_CHECKING:
    from kvengine.semantics import ModelKVSpec

EXIT_OK, EXIT_REFUSED = 0, 1

#: Cache dtypes ``--dtype`` accepts (what the HF models kvengine attaches run their caches in; the vLLM
#: connector refuses quantized KV, ``kv_cache_dtype`` other than 'auto').
DTYPES = ("float32", "float16", "bfloat16")


# -- per-integration verdicts -------------------------------------------------------------------
class Integration(enum.Enum):
    """The integrations a verdict is given for (value: the label printed)."""

    HF = "HF generate loop"
    VLLM = "vLLM connector"
    SGLANG = "SGLang HiCache backend"


class Support(enum.Enum):
    SUPPORTED = "supported"
    REFUSED = "refused"
    #: The integration decides from what its engine declares when it starts, not from the config.
    AT_START_UP = "checked at start-up"


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether one integration accepts a model, and why (or what it checks when it starts)."""

    integration: Integration
    support: Support
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"integration": self.integration.name.lower(), "name": self.integration.value,
                "verdict": self.support.value, "reason": self.reason}

    def line(self) -> str:
        return f"{self.integration.value + ':':<24}{self.support.value}: {self.reason}"


def _hf_verdict(spec: ModelKVSpec) -> Verdict:
    # Mirrors kvengine.integrations.hf.attaching.attach(): it calls the same derive_spec() this report is built
    # from (refusals raise there), then runs the attach canary on the real model.
    if spec.encoder_only:
        return Verdict(Integration.HF, Support.REFUSED, "encoder-only: no cache between forward passes, "
                                                        "nothing to store")
    why = "the same KV spec attach() derives; the attach canary compares a cached continuation with a plain " \
          "prefill when the model is attached"
    return Verdict(Integration.HF, Support.SUPPORTED, why)


def _vllm_verdict(spec: ModelKVSpec) -> Verdict:
    """Mirrors integrations/vllm: connector.check_vllm_config (encoder-decoder), layout.plan_groups /
    layout._plan_one (spec classes: layout.SUPPORTED_SPECS; anything else refused), and
    layout.derive_layout (ATTENTION_BACKENDS, PROVABLE_BACKENDS, REFUSED_BACKENDS, STATE_BACKENDS)."""
    from kvengine.chunks.layout import KVCategory
    from kvengine.integrations.vllm.layout import ATTENTION_BACKENDS, PROVABLE_BACKENDS, STATE_BACKENDS

    v = Integration.VLLM
    if spec.encoder_only:  # layout.plan_groups
        return Verdict(v, Support.REFUSED, "it has no KV cache groups (encoder-only or pooling model)")
    if spec.encoder_decoder:  # connector.check_vllm_config
        return Verdict(v, Support.REFUSED, "encoder-decoder models are not supported")
    categories = {g.category for g in spec.groups}
    reasons = []
    # layout.derive_layout -> _state_tensor: recurrent state only on the validated state backends.
    state_kinds = sorted({g.part.kind for g in spec.groups if g.category is KVCategory.LINEAR_STATE
                          and hasattr(g.part, "kind")})
    unvalidated = [k for k in state_kinds if _VLLM_STATE_BACKEND.get(k) not in STATE_BACKENDS]
    if unvalidated:
        reasons.append(f"{'/'.join(unvalidated)} recurrent state runs on a vLLM state backend that has not been "
                       f"validated (supported: {sorted(STATE_BACKENDS)})")
    if reasons:
        return Verdict(v, Support.REFUSED, "; ".join(reasons))
    if KVCategory.MLA_LATENT in categories:
        return Verdict(v, Support.AT_START_UP, "MLA latent pages (MLAAttentionSpec, one latent per token) are "
                                               "reused on vLLM's AMX_MLA backend (CPUs with AMX, bf16), at tensor "
                                               "parallel size 1 or 2 (rank 0 stores one copy, every rank loads "
                                               "it); the reference CPU_MLA backend vLLM picks elsewhere is "
                                               "refused: it has no prefill-with-context path")
    if KVCategory.ATTENTION_SINK in categories:
        return Verdict(v, Support.AT_START_UP, "learned attention sinks (weights, not KV): accepted where vLLM "
                                               "declares the layers as FullAttentionSpec / SlidingWindowSpec on a "
                                               f"validated backend {sorted(ATTENTION_BACKENDS)}, as for gpt-oss "
                                               "(validated exact)")
    conditions = [f"attention backend in {sorted(ATTENTION_BACKENDS)} (or in {sorted(PROVABLE_BACKENDS)} with a "
                  "verification record of the running platform: kvengine verify vllm)", "kv_cache_dtype 'auto'",
                  "pipeline parallel size 1",
                  "no speculative decoding"]
    if state_kinds:
        conditions.insert(0, "prefix caching on (mamba_cache_mode 'align')")
    return Verdict(v, Support.SUPPORTED, f"{_kinds(categories)}; checked at start-up: {', '.join(conditions)}")


#: StatePart.kind -> the vLLM recurrent-state backend its layers run on (only GDN_ATTN is in
#: integrations/vllm/layout.py STATE_BACKENDS; the others stand for "not that one").
_VLLM_STATE_BACKEND = {"gated_delta_net": "GDN_ATTN", "mamba2": "mamba2", "mamba1": "mamba1",
                       "short_conv": "short_conv"}

#: The refusal text of integrations/sglang/backend.py (_HYBRID_REFUSAL), which imports SGLang.
_SGLANG_HYBRID = "recurrent (Mamba / linear-attention) state: SGLang registers a state host pool for it, and the " \
                 "kvengine HiCache backend stores full-attention KV pages only (register_mem_host_pool_v2 refuses " \
                 "other pools)"


def _sglang_verdict(spec: ModelKVSpec) -> Verdict:
    """Mirrors integrations/sglang: backend.register_mem_host_pool_v2 (hybrid pools refused) and
    pages.geometry_of (MHATokenToKVPoolHost with K head dim == V head dim, MLATokenToKVPoolHost)."""
    from kvengine.chunks.layout import KVCategory
    from kvengine.integrations.sglang.pages import SUPPORTED_LAYOUTS, PoolKind

    s = Integration.SGLANG
    if spec.encoder_only:
        return Verdict(s, Support.REFUSED, "encoder-only: no cache between forward passes, nothing to store")
    categories = {g.category for g in spec.groups}
    if KVCategory.LINEAR_STATE in categories:
        return Verdict(s, Support.REFUSED, _SGLANG_HYBRID)
    for g in spec.groups:
        part = g.part
        key, value = getattr(part, "key_shape", None), getattr(part, "value_shape", None)
        if g.category is not KVCategory.MLA_LATENT and key is not None and value is not None and key[1] != value[1]:
            return Verdict(s, Support.REFUSED, f"MHA with K head dim {key[1]} != V head dim {value[1]} is not "
                                               "supported (pages.geometry_of)")
    pools = sorted(k.value for k in PoolKind)
    if spec.encoder_decoder:
        return Verdict(s, Support.AT_START_UP, f"the host pool SGLang builds for an encoder-decoder model must be "
                                               f"one of {pools}")
    if categories & {KVCategory.SLIDING_WINDOW, KVCategory.CHUNKED_LOCAL}:
        return Verdict(s, Support.AT_START_UP, "sliding-window / chunked layers: refused if SGLang runs them with "
                                               "a separate sliding-window host pool (hybrid SWA memory), accepted "
                                               "with one full-size pool")
    pool = PoolKind.MLA if KVCategory.MLA_LATENT in categories else PoolKind.MHA
    return Verdict(s, Support.SUPPORTED, f"{pool.value} pool; checked at start-up: host layout in "
                                         f"{list(SUPPORTED_LAYOUTS)}, no decode context parallelism")


def _kinds(categories: set[Any]) -> str:
    return " + ".join(sorted(c.name for c in categories))


def integration_verdicts(spec: ModelKVSpec) -> tuple[Verdict, ...]:
    """One verdict per integration for a model whose KV spec kvengine derives."""
    return _hf_verdict(spec), _vllm_verdict(spec), _sglang_verdict(spec)


def refused_verdicts(reason: str) -> tuple[Verdict, ...]:
    """The verdicts for a config kvengine's registry refuses (``reason``): the HF loop refuses it (attach calls
    derive_spec); the vLLM connector and the SGLang backend plan from what their engine declares at start-up."""
    later = "kvengine's registry cannot describe this config (see the HF verdict); the {who} decides from " \
            "{what} at start-up"
    vllm = later.format(who="connector", what="vLLM's KV cache groups")
    sglang = later.format(who="backend", what="the host pool SGLang registers")
    return (Verdict(Integration.HF, Support.REFUSED, reason), Verdict(Integration.VLLM, Support.AT_START_UP, vllm),
            Verdict(Integration.SGLANG, Support.AT_START_UP, sglang))


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def inspect_report(path: str, *, chunk_size: int = 256, dtype: str | None = None) -> dict[str, Any]:
    """The inspection as a JSON-able dict; ``refused`` is set instead of ``groups`` for refused models.

    :raises ModelConfigError: the config is missing, unreadable or malformed (a user error, not a refusal).
    """
    from kvengine.semantics import ModelConfigError, derive_spec, load_model_config

    out: dict[str, Any] = {"source": path, "chunk_size": chunk_size}
    try:
        spec = derive_spec(load_model_config(path), dtype=dtype)
    except ModelConfigError:
        raise
    except UnsupportedModelError as exc:
        out["refused"] = str(exc)
        out["integrations"] = [v.as_dict() for v in refused_verdicts(str(exc))]
        return out
    except (TypeError, ValueError, AttributeError, KeyError, ArithmeticError) as exc:  # values it cannot hold
        detail = one_line(exc)[:300]
        raise ModelConfigError(f"{path}: malformed model config ({type(exc).__name__}: {detail})") from None
    out.update(
        model_type=spec.model_type,
        architecture=spec.architecture,
        dtype=str(spec.dtype).removeprefix("torch."),
        layers=len(spec.layers),
        kv_spec_fingerprint=spec.fingerprint,
        notes=list(spec.notes),
    )
    out["integrations"] = [v.as_dict() for v in integration_verdicts(spec)]
    if spec.encoder_only:
        out["refused"] = "encoder-only model: it keeps no cache between forward passes, nothing to store"
        out["groups"] = []
        return out
    groups = []
    for g in spec.groups:
        p = g.policy
        groups.append({
            "group": g.gid,
            "name": g.name,
            "category": g.category.name,
            "layers": list(g.layers),
            "bytes_per_token": g.bytes_per_token,
            "bytes_per_boundary": g.bytes_per_boundary,
            "storage_per_1k_tokens": g.storage_per_tokens(1000, chunk_size),
            "match": p.match.value,
            "reuse_plan": g.reuse_plan(chunk_size),
            "why": p.why,
        })
    layout = spec.layout(chunk_size)
    out.update(
        groups=groups,
        bytes_per_token=spec.bytes_per_token,
        bytes_per_boundary=spec.bytes_per_boundary,
        chunk_bytes=layout.nbytes(),
        chunk_tensors=len(layout.tensors),
        storage_per_1k_tokens=spec.storage_per_tokens(1000, chunk_size),
        layout_id=layout.fingerprint,
    )
    return out


def _print_text(rep: dict[str, Any]) -> None:
    print(f"source        {rep['source']}")
    if "model_type" in rep:
        print(f"model_type    {rep['model_type']} ({rep['architecture']}), {rep['layers']} layers, {rep['dtype']}")
        print(f"kv spec       {rep['kv_spec_fingerprint']}")
    if rep.get("groups"):
        c = rep["chunk_size"]
        print(f"chunk size    {c} tokens; chunk = {_human(rep['chunk_bytes'])} in {rep['chunk_tensors']} tensors")
        print(f"per token     {_human(rep['bytes_per_token'])}   per boundary {_human(rep['bytes_per_boundary'])}"
              f"   per 1k tokens {_human(rep['storage_per_1k_tokens'])} (amortised)")
        print()
        for g in rep["groups"]:
            print(f"{g['name']}: {g['category']}")
            print(f"    bytes/token {_human(g['bytes_per_token'])}   bytes/boundary {_human(g['bytes_per_boundary'])}"
                  f"   per 1k tokens {_human(g['storage_per_1k_tokens'])}")
            print(f"    match at    {g['match']}")
            print(f"    plan        {g['reuse_plan']}")
            print(f"    why         {g['why']}")
    for note in rep.get("notes", []):
        print(f"note          {note}")
    if "refused" in rep:
        print(f"REFUSED       {rep['refused']}")
    if rep.get("integrations"):
        print()
        print("integrations")
        for v in rep["integrations"]:
            print(f"    {v['name'] + ':':<24}{v['verdict']}: {v['reason']}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvengine inspect``; returns the exit status."""
    parser = OneLineParser(prog="kvengine inspect", description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="model directory (holding config.json) or a config.json file")
    parser.add_argument("--list-refused", action="store_true",
                        help="list the families and features kvengine refuses, with reasons, and exit")
    parser.add_argument("--chunk-size", type=int, default=256, metavar="TOKENS",
                        help="tokens per chunk, for the per-chunk sizes and reuse plans (default 256)")
    parser.add_argument("--dtype", default=None, metavar="DTYPE",
                        help=f"cache dtype, one of {', '.join(DTYPES)} (default: the config's dtype, else float32)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of text")
    args = parser.parse_args(argv)
    if args.list_refused:
        from kvengine.semantics import refusal_reasons

        for what, why in refusal_reasons().items():
            print(f"{what}: {why}")
        return EXIT_OK
    if args.model is None:
        parser.error("a model directory or config.json is required (or --list-refused)")
    if args.chunk_size <= 0:
        parser.error("--chunk-size must be positive")
    if args.dtype is not None and args.dtype.removeprefix("torch.") not in DTYPES:
        parser.error(f"--dtype {args.dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    try:
        rep = inspect_report(args.model, chunk_size=args.chunk_size, dtype=args.dtype)
    except KVEngineError as exc:  # ModelConfigError (a refused family is reported, not raised)
        print(f"kvengine inspect: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        _print_text(rep)
    return EXIT_REFUSED if "refused" in rep else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

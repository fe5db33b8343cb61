"""``kvengine verify {hf,vllm} --model PATH_OR_TINY``: prove kvengine's reuse path on this machine and model.

Runs the integration's proof -- :mod:`kvengine.integrations.hf.verify_run`
(plain transformers against kvengine's generate) or
:mod:`kvengine.integrations.vllm.verify_run` (vLLM without the connector
against vLLM with it, a fresh engine process reading the persistent tiers,
preemption included) -- prints one verdict per KV layer group and, on
success, writes a verification record (:mod:`kvengine.trust.verification`)
and prints its path. A record of vLLM on a GPU attention backend is what lets
the connector serve on that backend (:mod:`kvengine.integrations.vllm.acceptance`).
Exit status: 0 proven (record written), 1 failed or past ``--max-seconds``
(the reason said), 2 refused (the model, or a usage error).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvengine.cli.arguments import EXIT_USAGE, OneLineParser, one_line, positive_int, positive_seconds
from kvengine.errors import AttachError, InvalidRequestError, UnsupportedModelError

if TYPE_CHECKING:
    from kvengine.trust.proof_run import ProofResult

EXIT_OK, EXIT_FAILED = 0, 1
DTYPES = ("float32", "bfloat16")


def _parser() -> OneLineParser:
    from kvengine.trust.verification import DEFAULT_RECORDS_DIR

    p = OneLineParser(prog="kvengine verify", description="Prove that kvengine's cached continuation equals a "
                      "plain run on this machine, model and configuration; write a verification record.")
    p.add_argument("integration", choices=("hf", "vllm"), help="the integration to verify")
    p.add_argument("--model", required=True, help="a local model directory (config.json + weights), or "
                   "tiny:<family> for a tiny random model of the zoo (e.g. tiny:llama)")
    p.add_argument("--dtype", choices=(*DTYPES, "float16", "auto"), default=None,
                   help="weights and KV dtype (default: float32 for hf, the model's own ('auto') for vllm)")
    p.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                   help="vllm: tensor-parallel ranks, as you serve (default 1)")
    p.add_argument("--engine-args", type=_json_object, default={},
                   help="vllm: further vLLM EngineArgs as a JSON object, as you serve, e.g. "
                        "'{\"compilation_config\": {\"custom_ops\": [\"all\", \"-rotary_embedding\"]}}'")
    p.add_argument("--config", help="kvengine.yaml: the tiers to verify (default: memory only)")
    p.add_argument("--records", default=str(DEFAULT_RECORDS_DIR),
                   help=f"directory of verification records (default {DEFAULT_RECORDS_DIR})")
    p.add_argument("--secret-file", help="seal the record with HMAC-SHA256 under this file's secret")
    p.add_argument("--max-new-tokens", type=positive_int, default=8, help="greedy tokens per request (default 8)")
    p.add_argument("--prompt-tokens", type=positive_int, default=None,
                   help="hf: first prompt's length (default 2.5 chunks + 1)")
    p.add_argument("--max-seconds", type=positive_seconds, default=None,
                   help="fail once this many seconds have passed, checked between the proof's steps "
                        "(default 300 for hf, 900 for vllm: three engine starts)")
    return p


def _json_object(text: str) -> dict[str, Any]:
    import argparse
    import json

    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def load_model(spec: str, dtype_name: str) -> Any:
    """``tiny:<family>`` from the tiny zoo, or a local directory through ``from_pretrained`` (no hub access).

    :raises InvalidRequestError: an unknown tiny family, or no model directory at that path.
    """
    import torch

    dtype = getattr(torch, dtype_name)
    if spec.startswith("tiny:"):
        from kvengine.integrations.hf.tiny_models import TINY_CONFIGS, build_tiny

        family = spec.removeprefix("tiny:")
        if family not in TINY_CONFIGS:
            raise InvalidRequestError(f"--model {spec}: no tiny family {family!r}; one of {', '.join(TINY_CONFIGS)}")
        return build_tiny(family, dtype=dtype)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(_model_dir(spec), local_files_only=True, dtype=dtype).eval()


def _model_dir(spec: str) -> Path:
    """:raises InvalidRequestError: no model directory at ``spec``."""
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise InvalidRequestError(f"--model {spec}: not a model directory (no config.json there)")
    return path


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from kvengine.trust.proof_run import ProofTimedOut
    from kvengine.trust.secrets import read_secret_file

    secret = read_secret_file(args.secret_file, "--secret-file")
    try:
        result = _run_hf(args) if args.integration == "hf" else _run_vllm(args)
    except (UnsupportedModelError, AttachError) as exc:
        where = "at attach" if args.integration == "hf" else "at start"
        print(f"kvengine verify: refused {where}: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except ProofTimedOut as exc:
        print(f"kvengine verify: FAILED: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return _report(result, args.records, secret)


def _run_hf(args: Any) -> ProofResult:
    from kvengine.config import load_config
    from kvengine.facade import KVEngine
    from kvengine.integrations.hf.verify_run import ProofSettings, run_proof

    if args.tensor_parallel_size != 1 or args.engine_args:
        raise InvalidRequestError("--tensor-parallel-size and --engine-args are vllm settings: kvengine verify hf "
                                  "runs the model in one process")
    dtype = args.dtype or "float32"
    if dtype not in DTYPES:
        raise InvalidRequestError(f"--dtype {dtype}: kvengine verify hf takes one of {', '.join(DTYPES)}")
    config = load_config(args.config if args.config else {"memory": {"capacity_bytes": "256MiB"}})
    model = load_model(args.model, dtype)
    settings = ProofSettings(max_new_tokens=args.max_new_tokens, prompt_tokens=args.prompt_tokens,
                             max_seconds=args.max_seconds or 300.0)
    fresh = config.disk.path is not None
    print(f"kvengine verify hf: {args.model} ({dtype}), chunk size {config.chunk_size}, reader pass on "
          f"{'a fresh engine over the disk tier' if fresh else 'the same engine (memory only)'}", flush=True)
    return run_proof(model, lambda: KVEngine(config), fresh_reader=fresh, model_id=args.model,
                     settings=settings, progress=lambda line: print(line, flush=True))


def _run_vllm(args: Any) -> ProofResult:
    from kvengine.config import load_config_auto_chunk
    from kvengine.integrations.vllm.verify_run import VllmProofSettings, run_proof

    if args.prompt_tokens is not None:
        raise InvalidRequestError("--prompt-tokens: kvengine verify vllm sizes its prompts from the chunk size")
    config, requested_chunk = load_config_auto_chunk(args.config)
    settings = VllmProofSettings(dtype=args.dtype or "auto", tensor_parallel_size=args.tensor_parallel_size,
                                 max_new_tokens=args.max_new_tokens, max_seconds=args.max_seconds or 900.0,
                                 engine_args=args.engine_args)
    model = _vllm_model_dir(args.model, args.dtype)
    print(f"kvengine verify vllm: {model} (dtype {settings.dtype}, tensor parallel size "
          f"{settings.tensor_parallel_size}), config {args.config or 'memory only'}", flush=True)
    return run_proof(model, args.config, config, requested_chunk, settings=settings,
                     progress=lambda line: print(line, flush=True))


def _vllm_model_dir(spec: str, dtype: str | None) -> str:
    """A model directory vLLM loads: ``spec`` itself, or ``tiny:<family>`` built in a temporary directory.

    :raises InvalidRequestError: an unknown tiny family, or no model directory at that path.
    """
    if spec.startswith("tiny:"):
        import tempfile

        from kvengine.integrations.vllm.tiny_models import FAMILIES, build_model_dir

        family = spec.removeprefix("tiny:")
        if family not in FAMILIES:
            raise InvalidRequestError(f"--model {spec}: no tiny family {family!r}; one of {', '.join(FAMILIES)}")
        folder = Path(tempfile.mkdtemp(prefix=f"kvengine-verify-{family}-"))
        return str(build_model_dir(folder, family, dtype=dtype if dtype in DTYPES else "float32"))
    return str(_model_dir(spec))


def _report(result: ProofResult, records: str, secret: bytes | None) -> int:
    """Print one verdict per group; on success write the record. Returns the exit status."""
    from kvengine.trust.verification import Outcome, VerificationRecord, kvengine_version, now, write_record

    for g in result.groups:
        measured = [e for e in (g.max_state_error, g.max_logprob_error, g.max_logit_error) if e is not None]
        kind = "" if g.outcome is not Outcome.EXACT else " (bitwise)" if not any(measured) else \
            " (within the dtype's tolerance)"
        state = "not compared (judged by the outputs)" if g.max_state_error is None else f"{g.max_state_error:.3g}"
        logit = "" if g.max_logit_error is None else f", max logit error {g.max_logit_error:.3g}"
        print(f"{g.group}: {g.outcome.value}{kind}  tokens loaded {g.tokens_loaded}, max state error {state}, "
              f"max logprob error {g.max_logprob_error:.3g}{logit}")
    if not result.ok:
        print(f"kvengine verify: FAILED: {result.failure}", file=sys.stderr)
        return EXIT_FAILED
    record = VerificationRecord(platform=result.platform, kvengine_version=kvengine_version(), model=result.model,
                                model_fingerprint=result.model_fingerprint, groups=result.groups, date=now())
    path = write_record(records, record, secret)
    print(f"verified: record written to {path}{' (sealed)' if secret else ''}")
    return EXIT_OK

"""``kvengine verify hf --model PATH_OR_TINY``: prove kvengine's reuse path on this machine and model.

Runs :mod:`kvengine.integrations.hf.verify_run` (plain transformers against
kvengine's generate, writer pass then a reader pass on a fresh engine when a
disk tier is configured), prints one verdict per KV layer group and, on
success, writes a verification record (:mod:`kvengine.trust.verification`)
and prints its path. Exit status: 0 proven (record written), 1 failed or
past ``--max-seconds`` (the reason said), 2 refused (the model at attach, or
a usage error). Only ``hf`` is implemented; ``vllm`` and ``sglang`` follow.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from kvengine.cli.arguments import EXIT_USAGE, OneLineParser, one_line, positive_int, positive_seconds
from kvengine.errors import AttachError, InvalidRequestError, UnsupportedModelError

EXIT_OK, EXIT_FAILED = 0, 1
DTYPES = ("float32", "bfloat16")


def _parser() -> OneLineParser:
    from kvengine.trust.verification import DEFAULT_RECORDS_DIR

    p = OneLineParser(prog="kvengine verify", description="Prove that kvengine's cached continuation equals a "
                      "plain run on this machine, model and configuration; write a verification record.")
    p.add_argument("integration", choices=("hf",), help="the integration to verify (hf; vllm and sglang to come)")
    p.add_argument("--model", required=True, help="a local model directory (config.json + weights), or "
                   "tiny:<family> for a tiny random model of the zoo (e.g. tiny:llama)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and KV dtype (default float32)")
    p.add_argument("--config", help="kvengine.yaml: the tiers to verify (default: memory only)")
    p.add_argument("--records", default=str(DEFAULT_RECORDS_DIR),
                   help=f"directory of verification records (default {DEFAULT_RECORDS_DIR})")
    p.add_argument("--secret-file", help="seal the record with HMAC-SHA256 under this file's secret")
    p.add_argument("--max-new-tokens", type=positive_int, default=8, help="greedy tokens per prompt (default 8)")
    p.add_argument("--prompt-tokens", type=positive_int, default=None,
                   help="first prompt's length (default 2.5 chunks + 1)")
    p.add_argument("--max-seconds", type=positive_seconds, default=300.0,
                   help="fail once this many seconds have passed, checked between the proof's steps (default 300)")
    return p


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
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise InvalidRequestError(f"--model {spec}: not a model directory (no config.json there)")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype).eval()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from kvengine import KVEngine, load_config
    from kvengine.integrations.hf.verify_run import ProofSettings, ProofTimedOut, run_proof
    from kvengine.trust.secrets import read_secret_file
    from kvengine.trust.verification import (
        Outcome,
        VerificationRecord,
        kvengine_version,
        now,
        write_record,
    )

    secret = read_secret_file(args.secret_file, "--secret-file")
    config = load_config(args.config if args.config else {"memory": {"capacity_bytes": "256MiB"}})
    model = load_model(args.model, args.dtype)
    settings = ProofSettings(max_new_tokens=args.max_new_tokens, prompt_tokens=args.prompt_tokens,
                             max_seconds=args.max_seconds)
    fresh = config.disk.path is not None
    print(f"kvengine verify hf: {args.model} ({args.dtype}), chunk size {config.chunk_size}, reader pass on "
          f"{'a fresh engine over the disk tier' if fresh else 'the same engine (memory only)'}", flush=True)
    try:
        result = run_proof(model, lambda: KVEngine(config), fresh_reader=fresh, model_id=args.model,
                           settings=settings, progress=lambda line: print(line, flush=True))
    except (UnsupportedModelError, AttachError) as exc:
        print(f"kvengine verify: refused at attach: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except ProofTimedOut as exc:
        print(f"kvengine verify: FAILED: {exc}", file=sys.stderr)
        return EXIT_FAILED
    for g in result.groups:
        exactly = g.max_state_error == g.max_logprob_error == g.max_logit_error == 0
        kind = "" if g.outcome is not Outcome.EXACT else " (bitwise)" if exactly else " (within the dtype's tolerance)"
        print(f"{g.group}: {g.outcome.value}{kind}  tokens loaded {g.tokens_loaded}, max state error {g.max_state_error:.3g}, "
              f"max logprob error {g.max_logprob_error:.3g}, max logit error {g.max_logit_error:.3g}")
    if not result.ok:
        print(f"kvengine verify: FAILED: {result.failure}", file=sys.stderr)
        return EXIT_FAILED
    record = VerificationRecord(platform=result.platform, kvengine_version=kvengine_version(), model=result.model,
                                model_fingerprint=result.model_fingerprint, groups=result.groups, date=now())
    path = write_record(args.records, record, secret)
    print(f"verified: record written to {path}{' (sealed)' if secret else ''}")
    return EXIT_OK

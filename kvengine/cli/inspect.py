"""``kvengine inspect <model dir | config.json>``: what kvengine would store for a model.

Reads the configuration only (no weights). Prints, per layer group, the
category, bytes per token and per chunk boundary, the reuse plan and the
storage per 1k tokens; a refused model or feature is printed with its
reason and the command exits 1. ``--json`` prints the same as JSON;
``--list-refused`` lists every refused family and feature with its reason.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvengine.errors import KVEngineError, UnsupportedModelError

EXIT_OK, EXIT_REFUSED, EXIT_USAGE = 0, 1, 2


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def inspect_report(path: str, *, chunk_size: int = 256, dtype: str | None = None) -> dict[str, Any]:
    """The inspection as a JSON-able dict; ``refused`` is set instead of ``groups`` for refused models."""
    from kvengine.semantics import derive_spec, load_model_config

    out: dict[str, Any] = {"source": path, "chunk_size": chunk_size}
    try:
        config = load_model_config(path)
        spec = derive_spec(config, dtype=dtype)
    except UnsupportedModelError as exc:
        out["refused"] = str(exc)
        return out
    out.update(
        model_type=spec.model_type,
        architecture=spec.architecture,
        dtype=str(spec.dtype).removeprefix("torch."),
        layers=len(spec.layers),
        kv_spec_fingerprint=spec.fingerprint,
        notes=list(spec.notes),
    )
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


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvengine inspect``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="kvengine inspect", description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="model directory or config.json")
    parser.add_argument("--list-refused", action="store_true",
                        help="list the families and features kvengine refuses, with reasons")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--dtype", default=None, help="cache dtype (default: the config's dtype, else float32)")
    parser.add_argument("--json", action="store_true", help="print JSON")
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
    try:
        rep = inspect_report(args.model, chunk_size=args.chunk_size, dtype=args.dtype)
    except KVEngineError as exc:
        print(f"kvengine inspect: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        _print_text(rep)
    return EXIT_REFUSED if "refused" in rep else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

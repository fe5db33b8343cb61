"""What identifying a model by the content of its weights costs (kvengine.trust.weights).

    .venv/bin/python benchmarks/bench_fingerprint.py [--gib 2] [--files 4] [--repeats 3]

Writes ``--files`` weight files of ``--gib`` GiB in total (random bytes) and measures, median of
``--repeats`` each, side by side:

* raw read: plain sequential reads of the same files, page cache dropped (the disk's limit);
* cold: every byte hashed, page cache dropped, no sidecar (a first start);
* warm: every byte hashed from the page cache, no sidecar (the hashing itself);
* sidecar: a restart with unchanged files (stat only);
* one file rewritten: a restart after an in-place update of one shard.

Seconds per GB and the ratio of cold hashing to the raw read go in ``results/fingerprint.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _util import drop_caches, median_time, print_header, print_table, write_json

from kvengine.trust.weights import DigestSidecar, fingerprint_model_path


def raw_read(files: list[Path]) -> None:
    buf = bytearray(8 << 20)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args()
    print_header()
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-fingerprint-"))
    model = root / "model"
    model.mkdir(parents=True, exist_ok=True)
    per_file = int(args.gib * 2**30 / args.files)
    files = []
    for i in range(args.files):
        path = model / f"model-{i:05d}-of-{args.files:05d}.safetensors"
        if not path.exists() or path.stat().st_size != per_file:
            with open(path, "wb") as f:
                for _ in range(0, per_file, 64 << 20):
                    f.write(os.urandom(min(64 << 20, per_file - f.tell())))
        files.append(path)
    gb = per_file * args.files / 1e9
    sidecar_path = root / "sidecar.json"

    def cold_setup() -> None:
        drop_caches(files)

    t_raw = median_time(lambda: raw_read(files), args.repeats, setup=cold_setup)
    t_cold = median_time(lambda: fingerprint_model_path(model), args.repeats, setup=cold_setup)
    raw_read(files)
    t_warm = median_time(lambda: fingerprint_model_path(model), args.repeats)
    sidecar_path.unlink(missing_ok=True)
    fingerprint_model_path(model, sidecar=DigestSidecar(sidecar_path))  # fills the sidecar
    t_sidecar = median_time(lambda: fingerprint_model_path(model, sidecar=DigestSidecar(sidecar_path)),
                            args.repeats, setup=cold_setup)

    def rewrite_one() -> None:
        with open(files[0], "r+b") as f:  # same size, one byte changed: the ctime moves
            f.seek(per_file // 2)
            f.write(os.urandom(1))
        drop_caches(files)

    t_one = median_time(lambda: fingerprint_model_path(model, sidecar=DigestSidecar(sidecar_path)),
                        args.repeats, setup=rewrite_one)
    rows = [
        ["raw read, cold", t_raw, t_raw / gb, gb / t_raw, 1.0],
        ["hash every byte, cold (first start)", t_cold, t_cold / gb, gb / t_cold, t_cold / t_raw],
        ["hash every byte, page cache warm", t_warm, t_warm / gb, gb / t_warm, t_warm / t_raw],
        ["restart, unchanged (sidecar)", t_sidecar, t_sidecar / gb, gb / t_sidecar, t_sidecar / t_raw],
        [f"restart, 1 of {args.files} files rewritten", t_one, t_one / gb, gb / t_one, t_one / t_raw],
    ]
    print_table(f"model fingerprint, {args.files} files, {gb:.2f} GB (median of {args.repeats})",
                ["what", "s", "s/GB", "GB/s", "time / raw read"], rows)
    path = write_json("fingerprint.json", {
        "gb": gb, "files": args.files, "repeats": args.repeats,
        "rows": {r[0]: {"seconds": r[1], "s_per_gb": r[2], "gb_per_s": r[3], "ratio_to_raw_read": r[4]} for r in rows},
    })
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Records forged as another kernel's KV: values changed, checksums recomputed, so they still verify.

Shared by the HF provenance tests and the vLLM scenarios (imported there as a plain module: the
scenarios run as a script from this folder).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvengine.chunks.record import encode_header, unpack_record


def scale_records(disk: Path, *, scale: float = 1.05, skip: tuple[str, ...] = ()) -> int:
    """Scale every float32 value of the records under ``disk`` (names not starting with ``skip``);
    returns how many records were rewritten."""
    n = 0
    for path in sorted(disk.glob("*.kvc")):
        if path.name.startswith(skip):
            continue
        header, payload = unpack_record(path.read_bytes())
        data = (torch.frombuffer(bytearray(payload), dtype=torch.float32) * scale).numpy().tobytes()
        path.write_bytes(encode_header(header.key, (header.token_start, header.token_end), header.tensors,
                                       codec_id=header.codec_id, raw_length=header.raw_length, payload=data,
                                       flags=header.flags) + data)
        n += 1
    return n

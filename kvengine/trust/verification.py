"""Verification records: proof, kept on disk, that kvengine's reuse path was exact on one platform.

``kvengine verify`` runs the exactness proof on the user's own machine, model
and configuration and, on success, writes a :class:`VerificationRecord`:

* :class:`Platform` -- everything the proof depended on: accelerator and its
  model (CPU model name and the ISA flags kernels dispatch on, or the CUDA
  device, driver and CUDA versions), torch, the inference engine and its
  version, attention backend, KV dtype, KV layout id, block size and
  tensor-parallel size;
* the kvengine version, the model fingerprint (the namespace's weights
  fingerprint), one :class:`GroupVerdict` per KV layer group, the date.

A record is JSON (keys sorted, compact: the same record is the same bytes)
named by a digest of (platform, model fingerprint, kvengine version), with a
content digest (an edit is detected) and, when a secret is configured, an
HMAC-SHA256 seal (an edit cannot be re-digested into a valid record without
the secret). :func:`find_matching` returns a record only when every platform
field, the model and the kvengine version match exactly and the digest and
seal verify: a record of another platform, model or version unlocks nothing.
Records are read as untrusted input (:func:`kvengine.untrusted_files.read_json`).

This module imports no inference engine (torch only inside
:meth:`Platform.on_host`, which reads the accelerator): the integrations describe their engine.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import json
import logging
import os
import platform as _platform
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvengine.untrusted_files import MalformedFileError, UnsafeFileError, read_json, write_atomic

logger = logging.getLogger("kvengine.trust")

#: Where records go unless ``--records DIR`` says otherwise.
DEFAULT_RECORDS_DIR = Path("~/.cache/kvengine/verifications")
#: Version of the record's JSON form.
FORMAT = 1
#: CPU flags that change which kernels torch runs (and so the rounding of a computation).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


@dataclass(frozen=True, slots=True, kw_only=True)
class Platform:
    """What a verification ran on; a record unlocks only a platform equal to it in every field."""

    accelerator: str  # "cpu" or "cuda"
    accelerator_model: str  # CPU model name, or the CUDA device name
    isa_flags: tuple[str, ...] = ()  # CPU only: the :data:`ISA_FLAGS` present
    driver_version: str | None = None  # CUDA only
    cuda_version: str | None = None  # CUDA only
    torch_version: str
    engine: str  # "hf", "vllm" or "sglang"
    engine_version: str
    attention_backend: str | None
    kv_dtype: str
    kv_layout_id: str
    block_size: int
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.accelerator not in ("cpu", "cuda"):
            raise ValueError(f"Platform.accelerator must be 'cpu' or 'cuda', got {self.accelerator!r}")
        if self.block_size <= 0 or self.tensor_parallel_size <= 0:
            raise ValueError("Platform.block_size and tensor_parallel_size must be positive")
        object.__setattr__(self, "isa_flags", tuple(sorted(self.isa_flags)))

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["isa_flags"] = list(self.isa_flags)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Platform:
        """:raises ValueError: a missing, unknown or mistyped field."""
        return cls(**_fields(cls, data, tuples={"isa_flags"}))

    @classmethod
    def on_host(cls, device_type: str, *, engine: str, engine_version: str, attention_backend: str | None,
                kv_dtype: str, kv_layout_id: str, block_size: int, tensor_parallel_size: int = 1) -> Platform:
        """This host's platform for a model running on ``device_type``: the accelerator fields read here
        (:func:`_host_accelerator`), the engine's given by the integration."""
        return cls(**_host_accelerator(device_type), engine=engine, engine_version=engine_version,
                   attention_backend=attention_backend, kv_dtype=kv_dtype, kv_layout_id=kv_layout_id,
                   block_size=block_size, tensor_parallel_size=tensor_parallel_size)


class Outcome(enum.Enum):
    """A KV layer group's verdict."""

    EXACT = "EXACT"
    DIFFERS = "DIFFERS"


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupVerdict:
    """One KV layer group: its verdict, what was measured and how many tokens were loaded from the tiers."""

    group: str
    outcome: Outcome
    #: the loaded KV against the KV a plain run computes for the same tokens; None where the integration
    #: cannot compare this group's state with a recompute (its verdict then rests on the outputs alone)
    max_state_error: float | None
    max_logprob_error: float  # per-step log-probabilities of the cached path against a plain run
    max_logit_error: float | None  # None where the engine returns no logits (vLLM: log-probabilities only)
    tokens_loaded: int

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "outcome": self.outcome.value}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GroupVerdict:
        fields = _fields(cls, data)
        return cls(**{**fields, "outcome": Outcome(fields["outcome"])})


@dataclass(frozen=True, slots=True, kw_only=True)
class VerificationRecord:
    """A successful verification of one model on one platform by one kvengine version."""

    platform: Platform
    kvengine_version: str
    model: str  # the model's name, for people; matching uses the fingerprint
    model_fingerprint: str
    groups: tuple[GroupVerdict, ...]
    date: str  # ISO 8601, UTC

    @property
    def exact(self) -> bool:
        return bool(self.groups) and all(g.outcome is Outcome.EXACT and g.tokens_loaded > 0 for g in self.groups)

    def body(self) -> dict[str, Any]:
        return {"format": FORMAT, "platform": self.platform.as_dict(), "kvengine_version": self.kvengine_version,
                "model": self.model, "model_fingerprint": self.model_fingerprint,
                "groups": [g.as_dict() for g in self.groups], "date": self.date}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> VerificationRecord:
        """:raises ValueError: not a record of this format."""
        if body.get("format") != FORMAT:
            raise ValueError(f"record format {body.get('format')!r}, expected {FORMAT}")
        groups = body.get("groups")
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise ValueError("groups: expected a list of objects")
        platform = body.get("platform")
        if not isinstance(platform, dict):
            raise ValueError("platform: expected an object")
        text = {k: body.get(k) for k in ("kvengine_version", "model", "model_fingerprint", "date")}
        if not all(isinstance(v, str) for v in text.values()):
            raise ValueError("kvengine_version, model, model_fingerprint and date must be strings")
        return cls(platform=Platform.from_dict(platform), groups=tuple(GroupVerdict.from_dict(g) for g in groups),
                   **text)  # type: ignore[arg-type]


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def kvengine_version() -> str:
    """The installed kvengine's version ("unknown" in a source tree that is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvengine")
    except PackageNotFoundError:  # a source tree that is not installed
        return "unknown"


def cpu_description(cpuinfo: str | None = None) -> tuple[str, tuple[str, ...]]:
    """(CPU model name, the :data:`ISA_FLAGS` it has) from ``/proc/cpuinfo`` (or ``cpuinfo``'s text)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    name, flags = "", set[str]()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not name:
            name = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return name or _platform.processor() or _platform.machine(), tuple(f for f in ISA_FLAGS if f in flags)


def _host_accelerator(device_type: str) -> dict[str, Any]:
    """The accelerator fields of :class:`Platform` for a model running on ``device_type`` (torch imported
    here, lazily, so that the record format itself needs no torch)."""
    import torch

    if device_type == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        driver = None
        try:
            import subprocess

            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=10).stdout.split()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            driver = "unknown"
        return {"accelerator": "cuda", "accelerator_model": props.name, "isa_flags": (),
                "driver_version": driver, "cuda_version": torch.version.cuda, "torch_version": torch.__version__}
    name, flags = cpu_description()
    return {"accelerator": "cpu", "accelerator_model": name, "isa_flags": flags, "driver_version": None,
            "cuda_version": None, "torch_version": torch.__version__}


def canonical(data: Any) -> bytes:
    """The JSON bytes digests and seals are computed over (sorted keys, no whitespace)."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def record_name(platform: Platform, model_fingerprint: str, version: str) -> str:
    """The file name of the record of (platform, model, kvengine version)."""
    key = canonical({"platform": platform.as_dict(), "model_fingerprint": model_fingerprint, "kvengine": version})
    return f"{hashlib.sha256(key).hexdigest()[:32]}.json"


def _seal(secret: bytes, body: bytes) -> str:
    return hmac.new(secret, b"kvengine-verification\0" + body, hashlib.sha256).hexdigest()


def serialise(record: VerificationRecord, secret: bytes | None = None) -> bytes:
    """The record's file content: its body, the body's SHA-256 and (with ``secret``) its HMAC-SHA256 seal."""
    body = record.body()
    data = canonical(body)
    out: dict[str, Any] = {"record": body, "sha256": hashlib.sha256(data).hexdigest()}
    if secret is not None:
        out["seal"] = _seal(secret, data)
    return json.dumps(out, sort_keys=True, indent=1).encode() + b"\n"


def write_record(records_dir: str | os.PathLike[str], record: VerificationRecord, secret: bytes | None = None) -> Path:
    """Publish ``record`` atomically under ``records_dir``; returns its path."""
    folder = Path(records_dir).expanduser()
    name = record_name(record.platform, record.model_fingerprint, record.kvengine_version)
    write_atomic(folder, name, serialise(record, secret))
    return folder / name


class Refusal(enum.Enum):
    """Why :func:`check_record` refused a record (its value: said in the log line)."""

    MISSING = "no record"
    UNREADABLE = "unreadable"
    DIGEST = "content digest does not verify (the record was edited)"
    UNSEALED = "not sealed, but a secret is configured"
    SEAL = "seal does not verify (edited, or sealed with another secret)"
    PLATFORM = "recorded on another platform"
    MODEL = "recorded for another model"
    VERSION = "recorded by another kvengine version"
    NOT_EXACT = "not every layer group was exact with tokens loaded"


@dataclass(frozen=True, slots=True)
class RecordCheck:
    """The record found for a platform and model (None when refused, with the refusal and its detail)."""

    record: VerificationRecord | None
    refusal: Refusal | None = None
    detail: str = ""


def check_record(path: str | os.PathLike[str], platform: Platform, model_fingerprint: str, version: str,
                 secret: bytes | None) -> RecordCheck:
    """Read ``path`` as untrusted input and check it against the running platform, model and version."""
    try:
        data = read_json(Path(path))
    except FileNotFoundError:
        return RecordCheck(None, Refusal.MISSING, str(path))
    except (UnsafeFileError, MalformedFileError, OSError) as exc:
        return RecordCheck(None, Refusal.UNREADABLE, str(exc))
    if not isinstance(data, dict) or not isinstance(data.get("record"), dict) or \
            not isinstance(data.get("sha256"), str):
        return RecordCheck(None, Refusal.UNREADABLE, f"{path}: not a verification record")
    try:
        body = canonical(data["record"])
    except ValueError as exc:
        return RecordCheck(None, Refusal.UNREADABLE, f"{path}: {exc}")
    if not hmac.compare_digest(hashlib.sha256(body).hexdigest(), data["sha256"]):
        return RecordCheck(None, Refusal.DIGEST, str(path))
    if secret is not None:
        seal = data.get("seal")
        if not isinstance(seal, str):
            return RecordCheck(None, Refusal.UNSEALED, str(path))
        if not hmac.compare_digest(_seal(secret, body), seal):
            return RecordCheck(None, Refusal.SEAL, str(path))
    try:
        record = VerificationRecord.from_body(data["record"])
    except (ValueError, TypeError) as exc:
        return RecordCheck(None, Refusal.UNREADABLE, f"{path}: {exc}")
    if record.platform != platform:
        diff = [f"{k}: recorded {v!r}, running {platform.as_dict()[k]!r}"
                for k, v in record.platform.as_dict().items() if platform.as_dict()[k] != v]
        return RecordCheck(None, Refusal.PLATFORM, "; ".join(diff))
    if record.model_fingerprint != model_fingerprint:
        return RecordCheck(None, Refusal.MODEL, f"recorded {record.model_fingerprint!r}")
    if record.kvengine_version != version:
        return RecordCheck(None, Refusal.VERSION, f"recorded {record.kvengine_version!r}, running {version!r}")
    if not record.exact:
        return RecordCheck(None, Refusal.NOT_EXACT, str(path))
    return RecordCheck(record)


def check_in(records_dir: str | os.PathLike[str], platform: Platform, model_fingerprint: str,
             kvengine_version: str, secret: bytes | None) -> tuple[Path, RecordCheck]:
    """Where the record of (platform, model, kvengine version) lives under ``records_dir``, and
    :func:`check_record`'s verdict on it."""
    path = Path(records_dir).expanduser() / record_name(platform, model_fingerprint, kvengine_version)
    return path, check_record(path, platform, model_fingerprint, kvengine_version, secret)


def find_matching(records_dir: str | os.PathLike[str], platform: Platform, model_fingerprint: str,
                  kvengine_version: str, secret: bytes | None) -> VerificationRecord | None:
    """The record that verifies this exact (platform, model, kvengine version), or None; a record that
    exists but is refused is logged with the reason (:func:`check_record` returns it)."""
    path, check = check_in(records_dir, platform, model_fingerprint, kvengine_version, secret)
    if check.refusal is not None and check.refusal is not Refusal.MISSING:
        logger.warning("kvengine: verification record %s refused: %s (%s)", path, check.refusal.value, check.detail)
    return check.record


def _fields(cls: type, data: Mapping[str, Any], *, tuples: frozenset[str] | set[str] = frozenset()) -> dict[str, Any]:
    """``data``'s fields for dataclass ``cls``: exactly its fields, lists made tuples for ``tuples``."""
    names = {f.name for f in dataclasses.fields(cls)}
    if set(data) != names:
        raise ValueError(f"{cls.__name__}: fields {sorted(set(data) ^ names)} missing or unknown")
    return {k: tuple(v) if k in tuples and isinstance(v, list) else v for k, v in data.items()}

"""A model's identity from the content of its weight files, cheap to repeat.

A model directory overwritten in place keeps its path, its file sizes and,
with ``cp -p`` or a restored archive, even its modification times: only the
bytes tell the old weights from the new. So every byte of every weight file
is hashed (streaming xxh3-128, files on parallel threads), and each file's
digest is remembered in a small sidecar keyed by its
``(path, size, mtime_ns, inode, ctime_ns)``. A restart re-hashes nothing
unchanged, and any rewrite misses the sidecar: a file's ctime changes with
every write and cannot be set by its owner.

Hub ids resolve to their local snapshot (the directory of the downloaded
commit), whose revision and file digests then make the identity.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvengine.errors import ConfigError
from kvengine.untrusted_files import read_json

logger = logging.getLogger("kvengine.trust.weights")

#: Files that hold weights (or that change what the weights compute: adapters, GGUF).
WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".npz"})
_BLOCK = 8 << 20
#: A digest sidecar holds about 150 B per weight file.
_SIDECAR_MAX_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class FileStamp:
    """What the filesystem says about a file; any write changes it (ctime at least)."""

    path: str
    size: int
    mtime_ns: int
    inode: int
    ctime_ns: int

    @classmethod
    def of(cls, path: Path) -> FileStamp:
        real = path.resolve()  # hub snapshots link to blobs: the blob is what is read
        st = real.stat()
        return cls(str(real), st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)

    def key(self) -> str:
        return f"{self.path}\0{self.size}\0{self.mtime_ns}\0{self.inode}\0{self.ctime_ns}"


def default_sidecar_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvengine" / "weight-digests.json"


class DigestSidecar:
    """File digests from earlier runs, in one JSON file (a missing or damaged one is empty).

    Writes replace the file atomically after merging what other processes added meanwhile.
    """

    def __init__(self, path: Path | None = None) -> None:
        self.path = Path(path) if path is not None else default_sidecar_path()
        self._lock = threading.Lock()
        self._digests = self._read()
        self._dirty = False

    def _read(self) -> dict[str, str]:
        try:
            # Read like any file another process can write: no FIFO, link or nesting stalls a start.
            data = read_json(self.path, max_bytes=_SIDECAR_MAX_BYTES)
            return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def get(self, stamp: FileStamp) -> str | None:
        with self._lock:
            return self._digests.get(stamp.key())

    def put(self, stamp: FileStamp, digest: str) -> None:
        with self._lock:
            self._digests[stamp.key()] = digest
            self._dirty = True

    def save(self) -> None:
        with self._lock:
            if not self._dirty:
                return
            merged = {**self._read(), **self._digests}
            # Entries of files that no longer exist would only grow the file.
            merged = {k: v for k, v in merged.items() if os.path.exists(k.split("\0", 1)[0])}
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(merged, sort_keys=True))
                os.replace(tmp, self.path)
                self._digests, self._dirty = merged, False
            except OSError as exc:  # the fingerprint is still right, a restart just hashes again
                logger.warning("kvengine: cannot write the weights digest sidecar %s: %s", self.path, exc)


def file_digest(path: Path) -> str:
    """xxh3-128 of every byte of ``path``, read in 8 MiB blocks."""
    h = xxhash.xxh3_128()
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class WeightsDigest:
    """The content identity of a set of weight files, and what computing it cost."""

    digest: str
    files: int
    total_bytes: int
    #: bytes actually read this time (the rest came from the sidecar)
    hashed_bytes: int
    seconds: float


def weight_files(directory: Path) -> list[Path]:
    """The weight files under ``directory`` (recursively, hidden folders skipped), sorted."""
    out = []
    for root, dirs, files in os.walk(directory, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out += [Path(root) / f for f in files if Path(f).suffix in WEIGHT_SUFFIXES]
    return sorted(out)


def fingerprint_files(files: Sequence[Path], *, base: Path, sidecar: DigestSidecar | None = None,
                      threads: int = 4) -> WeightsDigest:
    """Digest of ``files`` (names relative to ``base``, sizes and full-content digests)."""
    t0 = time.perf_counter()
    stamps = [FileStamp.of(f) for f in files]
    known: list[str | None] = [sidecar.get(s) if sidecar is not None else None for s in stamps]
    todo = [i for i, d in enumerate(known) if d is None]
    with ThreadPoolExecutor(max(1, min(threads, len(todo) or 1)), thread_name_prefix="kvengine-hash") as pool:
        for i, hashed in zip(todo, pool.map(lambda i: file_digest(files[i]), todo)):
            known[i] = hashed
            if sidecar is not None:
                sidecar.put(stamps[i], hashed)
    if sidecar is not None and todo:
        sidecar.save()
    h = xxhash.xxh3_128()
    for f, stamp, digest in zip(files, stamps, known):  # every digest is known by now
        h.update(f"{f.relative_to(base).as_posix()}\0{stamp.size}\0{digest}\n".encode())
    return WeightsDigest(h.hexdigest(), len(files), sum(s.size for s in stamps),
                         sum(stamps[i].size for i in todo), time.perf_counter() - t0)


def fingerprint_model_path(path: Path, *, sidecar: DigestSidecar | None = None) -> WeightsDigest:
    """A model directory's weights (or a single weight file, e.g. GGUF).

    :raises ConfigError: no weight file there (nothing to prove the identity with).
    """
    path = Path(path)
    if path.is_file():
        return fingerprint_files([path], base=path.parent, sidecar=sidecar)
    files = weight_files(path) if path.is_dir() else []
    if not files:
        raise ConfigError(f"no weight files ({', '.join(sorted(WEIGHT_SUFFIXES))}) under {path}: kvengine cannot "
                          "fingerprint the model's weights; pass an explicit model_fingerprint")
    return fingerprint_files(files, base=path, sidecar=sidecar)


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """Where a model's files are, and the hub revision when it came from the hub cache."""

    path: Path
    revision: str | None


def resolve_model(model: str, revision: str | None = None) -> ResolvedModel:
    """A local path as is; a hub id to its downloaded snapshot (never downloads).

    :raises ConfigError: neither a local path nor a snapshot in the local hub cache.
    """
    local = Path(model).expanduser()
    if local.exists():
        return ResolvedModel(local, None)
    try:
        from huggingface_hub import snapshot_download

        snapshot = Path(snapshot_download(repo_id=model, revision=revision, local_files_only=True))
    except Exception as exc:  # not installed, not a repo id, not downloaded: nothing to hash
        raise ConfigError(f"model {model!r} is neither a local path nor a snapshot in the local Hugging Face "
                          f"cache ({type(exc).__name__}: {exc}); kvengine cannot fingerprint its weights: pass "
                          "an explicit model_fingerprint") from None
    return ResolvedModel(snapshot, snapshot.name)  # a snapshot folder is named by its commit hash


def model_identity(model: str, revision: str | None = None, *, explicit: str | None = None,
                   sidecar: DigestSidecar | None = None) -> str:
    """The weights part of a model's namespace: ``explicit`` if given (the user versions the weights),
    else the revision and content digest of the model's files (a sidecar at the default path when
    none is given).

    :raises ConfigError: the files cannot be found to hash; the message names ``model_fingerprint``.
    """
    if explicit is not None:
        return f"explicit:{explicit}"
    resolved = resolve_model(model, revision)
    digest = fingerprint_model_path(resolved.path, sidecar=sidecar or DigestSidecar())
    logger.info("kvengine: weights of %s: %d files, %.2f GB, %s (%.2f GB hashed in %.2f s)", model, digest.files,
                digest.total_bytes / 1e9, digest.digest, digest.hashed_bytes / 1e9, digest.seconds)
    return f"revision:{resolved.revision}:content:{digest.digest}"

"""Namespaces whose stored KV failed a provenance check, and are never served again.

A namespace is quarantined when KV stored under it differs from what the
model that reads it computes (the namespace canary, or a shadow check of a
hit): its bytes verify, but another model, kernel or library computed them.
From then on the engine answers every lookup of it with a miss and stores
nothing more in it, until an operator purges it (``kvengine quarantine``).

The unit is a namespace's *root* (:func:`root_digest`): the model identity
without the request-level parts (cache salt, keyed schemes, encoder inputs),
because a model that computes different KV does so for every salt and every
keyed sub-namespace alike.

With a disk tier, each quarantine is a marker file in ``<disk>/quarantine/``
(JSON: which model, why, when), so a restart and every other process on that
disk see it; the engine re-reads the folder periodically. Every binding also
leaves a small note in ``<disk>/namespaces/`` (its digest, root and model),
which is how an operator's purge finds every record under a root, whoever
wrote it. Without a disk tier a quarantine lasts as long as the process.

Those folders can be written by every process on the disk, so they are read
as untrusted (:mod:`kvengine.untrusted_files`): a file that is not a regular
file (a FIFO, a link), is over 64 KiB, nests its JSON more than 16 levels
deep or does not parse is skipped and logged with its path, never a hang of
the engine's start or of its lease reaper (which re-reads the markers).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import xxhash

from kvengine.chunks.keys import Namespace, NamespaceDigest
from kvengine.untrusted_files import list_dir, open_dir, read_json, write_atomic

T = TypeVar("T")

logger = logging.getLogger("kvengine.trust.quarantine")

FOLDER = "quarantine"
NAMESPACES = "namespaces"
_SUFFIX = ".json"


def root_namespace(namespace: Namespace) -> Namespace:
    """The model identity of ``namespace``: what every request-level variant of it shares."""
    return namespace.with_updates(cache_salt="", extra_keys=())


def root_digest(namespace: Namespace) -> str:
    """Hex digest of :func:`root_namespace` (the quarantine unit)."""
    return xxhash.xxh3_128_hexdigest(root_namespace(namespace).digest())


@dataclass(frozen=True, slots=True, kw_only=True)
class QuarantineEntry:
    """One quarantined namespace root: what it was, why, and the digests stored under it."""

    root: str
    model: str
    reason: str
    since: float
    details: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_data(cls, data: Any) -> QuarantineEntry:
        """The entry a parsed marker holds (KeyError, TypeError or ValueError if it holds none)."""
        return cls(root=str(data["root"]), model=str(data["model"]), reason=str(data["reason"]),
                   since=float(data["since"]),
                   details={str(k): str(v) for k, v in dict(data.get("details", {})).items()})


class Quarantine:
    """The quarantined roots of one engine (thread-safe), persisted under ``directory`` when given."""

    def __init__(self, directory: Path | None) -> None:
        self._disk = Path(directory) if directory is not None else None
        self._lock = threading.Lock()
        self._entries: dict[str, QuarantineEntry] = {}
        self._noted: set[str] = set()
        self._skipped: set[str] = set()  # unreadable markers already logged
        self.refresh()

    def __contains__(self, root: str) -> bool:
        return root in self._entries  # a dict read: safe without the lock

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[QuarantineEntry]:
        with self._lock:
            return sorted(self._entries.values(), key=lambda e: e.since)

    def note_binding(self, namespace: Namespace, binding_digest: NamespaceDigest) -> None:
        """Record on disk that ``binding_digest`` belongs to ``namespace``'s root (what a purge looks up)."""
        name = bytes(binding_digest).hex()
        if self._disk is None or name in self._noted:
            return
        self._noted.add(name)
        note = {"binding": name, "root": root_digest(namespace), "model": namespace.model}
        _write_atomic(self._disk / NAMESPACES / f"{name}{_SUFFIX}", json.dumps(note, sort_keys=True))

    def add(self, namespace: Namespace, reason: str, details: dict[str, str] | None = None) -> QuarantineEntry:
        """Quarantine ``namespace``'s root (idempotent: the first reason is kept)."""
        root = root_digest(namespace)
        with self._lock:
            existing = self._entries.get(root)
            if existing is not None:
                return existing
            entry = QuarantineEntry(root=root, model=namespace.model, reason=reason, since=time.time(),
                                    details=dict(details or {}))
            self._entries[root] = entry
        self._persist(entry)
        logger.error("kvengine: QUARANTINED namespace of model %r (root %s): %s. Its stored KV is no longer served; "
                     "inspect with 'kvengine quarantine list', purge with 'kvengine quarantine purge'",
                     namespace.model, root, reason)
        return entry

    def refresh(self) -> None:
        """Re-read the markers on disk (another process may have quarantined a namespace)."""
        if self._disk is None:
            return
        found, skipped = _read_all(self._disk / FOLDER, QuarantineEntry.from_data)
        for bad in skipped:  # refreshed every few seconds: each bad file is logged once
            if bad.path not in self._skipped:
                self._skipped.add(bad.path)
                logger.warning("kvengine: unreadable quarantine marker %s, skipped: %s", bad.path, bad.why)
        with self._lock:
            for entry in found:
                self._entries.setdefault(entry.root, entry)

    def _persist(self, entry: QuarantineEntry) -> None:
        if self._disk is not None:
            _write_atomic(self._disk / FOLDER / f"{entry.root}{_SUFFIX}", entry.to_json())


def _write_atomic(path: Path, text: str) -> None:
    try:
        write_atomic(path.parent, path.name, text.encode())
    except OSError as exc:  # the engine goes on; the file only serves later processes and purges
        logger.error("kvengine: cannot write %s: %s", path, exc)


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A file of a quarantine folder that was skipped: its path and why."""

    path: str
    why: str


def _read_all(folder: Path, parse: Callable[[object], T]) -> tuple[list[T], list[Unreadable]]:
    """Every ``*.json`` file of ``folder`` parsed, in name order, and the ones skipped.

    The folder is under the disk tier's directory, which other processes can write: each file is read
    through :mod:`kvengine.untrusted_files` (a regular file only, never blocking, bounded size and JSON
    depth), so a FIFO, a link or a huge or deeply nested file is skipped, never a hang or a crash.
    """
    try:
        dir_fd = open_dir(folder)
    except FileNotFoundError:
        return [], []
    except OSError as exc:
        return [], [Unreadable(str(folder), str(exc))]
    out: list[T] = []
    skipped: list[Unreadable] = []
    try:
        for name in list_dir(dir_fd):
            if not name.endswith(_SUFFIX) or name.startswith("."):  # ".<name>....tmp": a write in progress
                continue
            try:
                out.append(parse(read_json(name, dir_fd=dir_fd, where=folder)))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                skipped.append(Unreadable(str(folder / name), str(exc)))
    finally:
        os.close(dir_fd)
    return out, skipped


def _logged(found: tuple[list[T], list[Unreadable]], what: str) -> list[T]:
    parsed, skipped = found
    for bad in skipped:
        logger.warning("kvengine: unreadable %s %s, skipped: %s", what, bad.path, bad.why)
    return parsed


def read_markers(disk_path: Path) -> list[QuarantineEntry]:
    """The quarantine markers under a disk tier's directory (unreadable ones are skipped, logged)."""
    return _logged(_read_all(Path(disk_path) / FOLDER, QuarantineEntry.from_data), "quarantine marker")


@dataclass(frozen=True, slots=True)
class NamespaceNote:
    """A binding a process made on this disk: its digest (records' namespace), root and model."""

    binding: str
    root: str
    model: str


def read_namespace_notes(disk_path: Path) -> list[NamespaceNote]:
    """The namespace notes under a disk tier's directory (unreadable ones are skipped, logged)."""
    def parse(data: Any) -> NamespaceNote:
        return NamespaceNote(str(data["binding"]), str(data["root"]), str(data["model"]))

    return _logged(_read_all(Path(disk_path) / NAMESPACES, parse), "namespace note")


def remove_marker(disk_path: Path, root: str) -> bool:
    """Delete one marker (after its records were purged)."""
    try:
        (Path(disk_path) / FOLDER / f"{root}{_SUFFIX}").unlink()
        return True
    except FileNotFoundError:
        return False

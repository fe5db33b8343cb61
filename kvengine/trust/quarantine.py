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
from typing import TypeVar

import xxhash

from kvengine.chunks.keys import Namespace, NamespaceDigest

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
    def from_json(cls, text: str) -> QuarantineEntry:
        data = json.loads(text)
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
        found = read_markers(self._disk)
        with self._lock:
            for entry in found:
                self._entries.setdefault(entry.root, entry)

    def _persist(self, entry: QuarantineEntry) -> None:
        if self._disk is not None:
            _write_atomic(self._disk / FOLDER / f"{entry.root}{_SUFFIX}", entry.to_json())


def _write_atomic(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:  # the engine goes on; the file only serves later processes and purges
        logger.error("kvengine: cannot write %s: %s", path, exc)


def _read_all(folder: Path, parse: Callable[[str], T], what: str) -> list[T]:
    """Every ``*.json`` file of ``folder`` parsed, in name order; unreadable ones skipped and logged."""
    out = []
    for path in sorted(folder.glob(f"*{_SUFFIX}")):
        try:
            out.append(parse(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("kvengine: unreadable %s %s: %s", what, path, exc)
    return out


def read_markers(disk_path: Path) -> list[QuarantineEntry]:
    """The quarantine markers under a disk tier's directory (unreadable ones are skipped, logged)."""
    return _read_all(Path(disk_path) / FOLDER, QuarantineEntry.from_json, "quarantine marker")


@dataclass(frozen=True, slots=True)
class NamespaceNote:
    """A binding a process made on this disk: its digest (records' namespace), root and model."""

    binding: str
    root: str
    model: str


def read_namespace_notes(disk_path: Path) -> list[NamespaceNote]:
    def parse(text: str) -> NamespaceNote:
        data = json.loads(text)
        return NamespaceNote(str(data["binding"]), str(data["root"]), str(data["model"]))

    return _read_all(Path(disk_path) / NAMESPACES, parse, "namespace note")


def remove_marker(disk_path: Path, root: str) -> bool:
    """Delete one marker (after its records were purged)."""
    try:
        (Path(disk_path) / FOLDER / f"{root}{_SUFFIX}").unlink()
        return True
    except FileNotFoundError:
        return False

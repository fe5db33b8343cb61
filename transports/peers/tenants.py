"""Which authenticated client may touch which namespaces of a peer server.

A peer server shared by several tenants must keep each one to its own
chunks: reading another tenant's KV leaks its prompts, writing or deleting
it poisons or starves its cache. Clients are identified by what their wire
proves: a ZeroMQ CURVE public key (40 Z85 characters), or the SHA-256
fingerprint of a TLS client certificate (``sha256:`` and 64 hex digits, see
:func:`kvengine.transports.peers.tcp.fingerprint`). Each key is granted to
one tenant, either to write (read, put, delete) or to read only.

A namespace belongs to one tenant:

* **pinned** -- listed under the tenant in the tenants file; or
* **claimed** -- otherwise, by the first tenant whose writer puts a record
  into it. Claims are kept in :class:`ClaimBook` (persisted when it has a
  path, so a restart cannot hand a namespace to someone else).

A namespace that is neither pinned nor claimed has no records a tenant may
read. Everything a tenant may not touch is a miss (reads) or a refusal
(writes), counted by the server, and indistinguishable from an absent chunk
to the client.

Tenants file (JSON)::

    {"tenants": {
        "alice": {"writers": ["<Z85 public key>"], "readers": ["<Z85>"],
                  "namespaces": ["<32 hex digits>"]},
        "bob":   {"writers": ["sha256:<64 hex digits>"]}}}
"""

from __future__ import annotations

import enum
import json
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvengine.chunks.keys import DIGEST_BYTES, NamespaceDigest
from kvengine.errors import ConfigError

_FINGERPRINT = re.compile(rb"sha256:[0-9a-f]{64}")


def is_client_key(key: bytes) -> bool:
    """A CURVE public key (40 Z85 characters) or a TLS certificate fingerprint (``sha256:<hex>``)."""
    return len(key) == 40 or _FINGERPRINT.fullmatch(key) is not None


class Access(enum.Enum):
    READ = "read"  # exists, get
    WRITE = "write"  # put, delete


@dataclass(frozen=True, slots=True)
class Grant:
    """What one client key may do: act for ``tenant``, writing or reading only."""

    tenant: str
    writes: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantPolicy:
    """Client keys to grants, and the namespaces pinned to each tenant."""

    grants: Mapping[bytes, Grant]
    pinned: Mapping[NamespaceDigest, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.grants:
            raise ConfigError("a tenant policy needs at least one client key")
        if not all(is_client_key(k) for k in self.grants):
            raise ConfigError("tenant client keys must be 40-byte Z85 CURVE public keys or 'sha256:<64 hex>' "
                              "TLS certificate fingerprints")

    @property
    def client_keys(self) -> frozenset[bytes]:
        """Every key granted anything: the CURVE allow-list of a server under this policy."""
        return frozenset(self.grants)


class ClaimBook:
    """Namespace -> owning tenant, for namespaces not pinned; thread-safe; saved atomically when it has a path."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._owners: dict[NamespaceDigest, str] = {}
        self._lock = threading.Lock()
        if self.path is not None and self.path.exists():
            try:
                raw = json.loads(self.path.read_text())
                self._owners = {NamespaceDigest(bytes.fromhex(ns)): str(t) for ns, t in raw["claims"].items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ConfigError(f"tenant claims file {self.path}: unreadable ({exc}); fix or remove it") from None

    def owner(self, namespace: NamespaceDigest) -> str | None:
        return self._owners.get(namespace)

    def claim(self, namespace: NamespaceDigest, tenant: str) -> bool:
        """Make ``tenant`` the owner if nobody is; True if ``tenant`` owns it now.

        Blocking when persisted (a small file written and renamed): call it off the event loop.
        """
        with self._lock:
            owner = self._owners.setdefault(namespace, tenant)
            if owner == tenant and self.path is not None:
                self._save()
            return owner == tenant

    def _save(self) -> None:
        assert self.path is not None
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps({"claims": {ns.hex(): t for ns, t in sorted(self._owners.items())}}, indent=1))
        os.replace(tmp, self.path)


class Gatekeeper:
    """Answers "may this client do this to this namespace" under a :class:`TenantPolicy`."""

    def __init__(self, policy: TenantPolicy, claims: ClaimBook | None = None) -> None:
        self.policy = policy
        self.claims = claims or ClaimBook()

    def owner(self, namespace: NamespaceDigest) -> str | None:
        return self.policy.pinned.get(namespace) or self.claims.owner(namespace)

    def grant(self, client: bytes | None) -> Grant | None:
        return None if client is None else self.policy.grants.get(client)

    def permits(self, client: bytes | None, access: Access, namespace: NamespaceDigest) -> bool:
        """Whether ``client`` may read or write ``namespace`` now (a writer claims an unowned
        namespace by its first put)."""
        grant = self.grant(client)
        if grant is None or (access is Access.WRITE and not grant.writes):
            return False
        return self.owner(namespace) == grant.tenant

    def claim(self, client: bytes | None, namespace: NamespaceDigest) -> bool:
        """Claim an unowned namespace for ``client``'s tenant if it may write; True if that tenant owns it now.

        Blocking when claims are persisted: call it off the event loop.
        """
        grant = self.grant(client)
        if grant is None or not grant.writes or namespace in self.policy.pinned:
            return False
        return self.claims.claim(namespace, grant.tenant)


def load_tenants(path: str | os.PathLike[str]) -> TenantPolicy:
    """Read a tenants file (format in the module docstring); every mistake is a :class:`ConfigError`
    naming the file and the entry."""
    where = f"tenants file {path}"
    try:
        raw = json.loads(Path(path).read_text())
        tenants = raw["tenants"]
        if not isinstance(tenants, dict) or not tenants:
            raise ValueError("'tenants' must be a non-empty object")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    grants: dict[bytes, Grant] = {}
    pinned: dict[NamespaceDigest, str] = {}
    for name, entry in tenants.items():
        if not isinstance(entry, dict) or set(entry) - {"writers", "readers", "namespaces"}:
            raise ConfigError(f"{where}: tenant {name!r} must be an object with writers, readers, namespaces")
        for role, writes in (("writers", True), ("readers", False)):
            for key in entry.get(role, []):
                encoded = key.encode() if isinstance(key, str) else b""
                if not is_client_key(encoded):
                    raise ConfigError(f"{where}: tenant {name!r} {role}: {key!r} is neither a 40-character Z85 "
                                      "CURVE key nor a 'sha256:<64 hex digits>' certificate fingerprint")
                if encoded in grants:
                    raise ConfigError(f"{where}: key {key} is granted twice (a key acts for one tenant)")
                grants[encoded] = Grant(name, writes)
        for ns in entry.get("namespaces", []):
            try:
                digest = bytes.fromhex(ns)
            except (TypeError, ValueError):
                digest = b""
            if len(digest) != DIGEST_BYTES:
                raise ConfigError(f"{where}: tenant {name!r}: {ns!r} is not a namespace digest (32 hex digits)")
            if pinned.setdefault(NamespaceDigest(digest), name) != name:
                raise ConfigError(f"{where}: namespace {ns} is pinned to two tenants")
    return TenantPolicy(grants=grants, pinned=pinned)

"""A throwaway certificate authority for TLS tests (the ``openssl`` command line, no extra package)."""

from __future__ import annotations

import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kvengine.transports.peers.tcp import TlsConfig, fingerprint

_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


@dataclass(frozen=True, slots=True)
class Pki:
    """A CA in ``root`` and certificates it signed, issued by :meth:`issue`."""

    root: Path

    @classmethod
    def create(cls, root: Path, name: str = "ca") -> Pki:
        root.mkdir(parents=True, exist_ok=True)
        _openssl("req", "-x509", *_KEY, "-keyout", root / f"{name}.key", "-out", root / f"{name}.pem",
                 "-subj", f"/CN=kvengine-test-{name}", "-days", "2")
        return cls(root / name)

    @property
    def ca(self) -> Path:
        return self.root.with_suffix(".pem")

    def issue(self, name: str) -> tuple[Path, Path]:
        """``(certificate, key)`` for ``name``, signed by this CA."""
        base = self.root.parent / name
        _openssl("req", *_KEY, "-keyout", f"{base}.key", "-out", f"{base}.csr", "-subj", f"/CN={name}")
        _openssl("x509", "-req", "-in", f"{base}.csr", "-CA", self.ca, "-CAkey", self.root.with_suffix(".key"),
                 "-CAcreateserial", "-out", f"{base}.pem", "-days", "2")
        return Path(f"{base}.pem"), Path(f"{base}.key")

    def tls(self, name: str, *, trust: Path | None = None) -> TlsConfig:
        """A :class:`TlsConfig` with a fresh certificate for ``name`` that trusts ``trust`` (default: this CA)."""
        cert, key = self.issue(name)
        return TlsConfig(cert=cert, key=key, ca=trust or self.ca)


def fingerprint_of(cert: Path) -> str:
    """The tenants-file name of a client certificate."""
    return fingerprint(ssl.PEM_cert_to_DER_cert(cert.read_text())).decode()

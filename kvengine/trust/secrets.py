"""A shared secret read from a file: the peer group's, the Mooncake tier's, a verification record's seal."""

from __future__ import annotations

import os
from pathlib import Path

from kvengine.errors import ConfigError

#: Shorter secrets are refused (HMAC-SHA256 keys; 32 random bytes recommended).
MIN_SECRET_BYTES = 16


def read_secret_file(path: str | os.PathLike[str] | None, setting: str) -> bytes | None:
    """The secret in ``path`` (its bytes, stripped of surrounding whitespace), or None without a path.

    :raises ConfigError: naming ``setting`` and the file, when it cannot be read or holds fewer than
        :data:`MIN_SECRET_BYTES` bytes.
    """
    if path is None:
        return None
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"{setting} {path}: cannot be read ({exc})") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"{setting} {path}: holds {len(secret)} bytes; use at least {MIN_SECRET_BYTES} "
                          "(e.g. `head -c 32 /dev/urandom | base64 > FILE`)")
    return secret

"""Files under a directory that other processes can write: the disk tier's directory.

Everything under a disk tier's directory (records, ``quarantine/``,
``namespaces/``) may have been put there by another process, an operator's
slip or an attacker with write access, so no reader trusts a name:

* it opens with ``O_NONBLOCK | O_NOFOLLOW``: a FIFO opens at once instead of
  waiting forever for a writer, and a symbolic link is refused (``ELOOP``)
  instead of followed out of the directory;
* it reads only a regular file (``fstat`` of the descriptor it opened, so a
  swap between check and read cannot matter), and only up to a size bound;
* it parses JSON within a size bound and a nesting-depth bound (Python's
  parser recurses: a deeply nested file raises ``RecursionError``).

A refusal is an :class:`UnsafeFileError` (an ``OSError``, so a reader that
treats I/O faults as misses treats it so too) or, for a file that is regular
but not valid JSON, a :class:`MalformedFileError` (a ``ValueError``); both name
the file and what was wrong. Writers publish with :func:`write_atomic`: a
fresh temp name created exclusively (never a planted FIFO or link), then a
rename.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from pathlib import Path

#: Flags of every read of a file under a shared directory.
READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_WRITE_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK
                | getattr(os, "O_CLOEXEC", 0))
#: Bounds of a JSON file under a shared directory (markers and notes are a few hundred bytes, depth 2).
JSON_MAX_BYTES = 64 * 1024
JSON_MAX_DEPTH = 16

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"))
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]")


class UnsafeFileError(OSError):
    """A path under a shared directory that is not a regular file within its size bound: never read."""

    def __init__(self, path: str, what: str) -> None:
        super().__init__(f"{path} is {what}: not read")
        self.path, self.what = path, what


class MalformedFileError(ValueError):
    """A regular file under a shared directory whose content cannot be used (not JSON, nested too deep)."""

    def __init__(self, path: str, what: str) -> None:
        super().__init__(f"{path}: {what}")
        self.path, self.what = path, what


def _shown(path: str | Path, dir_fd: int | None, where: str | Path | None) -> str:
    return str(Path(where) / path) if dir_fd is not None and where is not None else str(path)


def open_regular(path: str | Path, *, dir_fd: int | None = None, max_bytes: int | None = None,
                 where: str | Path | None = None) -> tuple[int, os.stat_result]:
    """Open a regular file for reading without blocking or following a link: ``(fd, its fstat)``.

    ``where`` names ``dir_fd``'s directory in error messages.

    :raises FileNotFoundError: nothing has that name.
    :raises UnsafeFileError: it is a FIFO, device, socket, directory or symbolic link, or over ``max_bytes``.
    """
    try:
        fd = os.open(path, READ_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link as the last component
            raise UnsafeFileError(_shown(path, dir_fd, where), "a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
            raise UnsafeFileError(_shown(path, dir_fd, where), kind)
        if max_bytes is not None and st.st_size > max_bytes:
            raise UnsafeFileError(_shown(path, dir_fd, where), f"{st.st_size} bytes (more than {max_bytes})")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_bounded(path: str | Path, *, max_bytes: int, dir_fd: int | None = None,
                 where: str | Path | None = None) -> bytes:
    """The bytes of a regular file of at most ``max_bytes`` (:func:`open_regular`'s refusals apply)."""
    fd, _ = open_regular(path, dir_fd=dir_fd, max_bytes=max_bytes, where=where)
    try:
        chunks, got = [], 0
        while got <= max_bytes:  # the file may grow after the fstat: read one byte past the bound at most
            piece = os.read(fd, max_bytes + 1 - got)
            if not piece:
                break
            chunks.append(piece)
            got += len(piece)
    finally:
        os.close(fd)
    if got > max_bytes:
        raise UnsafeFileError(_shown(path, dir_fd, where), f"more than {max_bytes} bytes")
    return b"".join(chunks)


def json_depth(text: str) -> int:
    """How deeply arrays and objects nest in ``text`` (strings skipped); linear, no recursion."""
    depth = deepest = 0
    for c in _NOT_BRACKET.sub("", _STRING.sub("", text)):
        depth += 1 if c in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def read_json(path: str | Path, *, dir_fd: int | None = None, where: str | Path | None = None,
              max_bytes: int = JSON_MAX_BYTES, max_depth: int = JSON_MAX_DEPTH) -> object:
    """Parse a small JSON file safely (see the module doc).

    :raises UnsafeFileError: not a regular file, or over ``max_bytes``.
    :raises MalformedFileError: not UTF-8 JSON, or nested deeper than ``max_depth``.
    """
    raw = read_bounded(path, max_bytes=max_bytes, dir_fd=dir_fd, where=where)
    shown = _shown(path, dir_fd, where)
    try:
        text = raw.decode()
    except UnicodeDecodeError as exc:
        raise MalformedFileError(shown, f"not UTF-8 ({exc.reason})") from None
    if (depth := json_depth(text)) > max_depth:
        raise MalformedFileError(shown, f"JSON nested {depth} levels deep (at most {max_depth})")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise MalformedFileError(shown, f"not JSON ({exc})") from None


def open_dir(path: str | Path) -> int:
    """A descriptor of the directory ``path``, whose last component must not be a symbolic link.

    :raises FileNotFoundError: there is none.
    :raises UnsafeFileError: it is a symbolic link or not a directory.
    """
    try:
        return os.open(path, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeFileError(str(path), "a symbolic link" if exc.errno == errno.ELOOP else "not a directory") \
                from None
        raise


def list_dir(dir_fd: int) -> list[str]:
    """The names in the directory open as ``dir_fd``, sorted."""
    return sorted(os.listdir(dir_fd))


def write_atomic(folder: Path, name: str, data: bytes) -> None:
    """Publish ``data`` as ``folder/name``: written to a fresh temp name (created exclusively, never
    through a planted FIFO or link), then renamed over whatever had the name. ``folder`` is created if
    missing; if it is a symbolic link, nothing is written.

    :raises OSError: the folder or the file cannot be written (:class:`UnsafeFileError` for a linked folder).
    """
    folder.mkdir(parents=True, exist_ok=True)
    dir_fd = open_dir(folder)
    try:
        tmp = f".{name}.{os.getpid()}.{os.urandom(6).hex()}.tmp"
        fd = os.open(tmp, _WRITE_FLAGS, 0o644, dir_fd=dir_fd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except BaseException:
            os.close(fd)
            os.unlink(tmp, dir_fd=dir_fd)
            raise
        os.close(fd)
        try:
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            os.unlink(tmp, dir_fd=dir_fd)
            raise
    finally:
        os.close(dir_fd)

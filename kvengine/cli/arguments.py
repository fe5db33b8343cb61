"""What the ``kvengine`` commands share about their arguments: argument types (a bad value is a
usage error), a parser whose errors are one line, and errors said in one line."""

from __future__ import annotations

import argparse
from typing import NoReturn

#: Exit status of a usage error (as argparse's).
EXIT_USAGE = 2


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (exit status 2), not usage + error."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def one_line(exc: BaseException) -> str:
    """An exception's message with its line breaks and runs of spaces folded (for one stderr line)."""
    return " ".join(str(exc).split())


def byte_size(text: str) -> int:
    """A size with an optional unit ("4GiB", "512MiB"; a bare number is bytes)."""
    from pydantic import ByteSize, TypeAdapter, ValidationError

    try:
        return int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4GiB, 512MiB)") from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {value}")
    return value

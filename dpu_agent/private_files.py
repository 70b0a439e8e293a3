"""Reading files that hold secrets (keys, tokens): bounded, with their permission bits."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path


def read_with_mode(path: Path, limit: int) -> tuple[bytes, int]:
    """At most `limit + 1` bytes of `path` and its permission bits (OSError if unreadable).

    One descriptor serves both, so the mode checked is the mode of the file read.
    Reading one byte past `limit` lets the caller tell "too large" from "exactly full".
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, limit + 1), os.fstat(fd).st_mode & 0o777
    finally:
        os.close(fd)

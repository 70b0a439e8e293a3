"""The agent's own files: read bounded and checked, or replaced durably.

Reading: keys, tokens and grants, bounded, with their permission bits. Replacing: its
state files (flow rules, functions), whole or not at all.
"""

from __future__ import annotations

import contextlib
import errno
import os
from typing import TYPE_CHECKING, Any

from dpu_agent import tomltext
from dpu_agent.errors import ResourceExhausted

if TYPE_CHECKING:
    from collections.abc import Callable
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


def read_toml(
    path: Path, limit: int, error: Callable[[str], Exception], *, secret: bool
) -> dict[str, Any]:
    """The TOML document of a file only its owner may change (nor read, if `secret`).

    The agent's own files of secrets and grants: at most `limit` bytes of UTF-8 TOML,
    whose mode lets group and others write nothing (and read nothing, if `secret`).
    Anything else raises `error(message)`, naming the file and what is wrong.
    """
    try:
        data, mode = read_with_mode(path, limit)
    except OSError as exc:
        raise error(f"{path}: cannot read: {exc.strerror}") from None
    if secret and mode & 0o077:
        raise error(f"{path} may be read by group or others (mode {mode:04o}); it must be 0600")
    if mode & 0o022:
        raise error(f"{path} may be written by group or others (mode {mode:04o})")
    if len(data) > limit:
        raise error(f"{path}: larger than {limit} bytes")
    try:
        return tomltext.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise error(f"{path}: not UTF-8 text") from None
    except tomltext.TomlError as exc:
        raise error(f"{path}: {exc}") from None


_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def replace_durably(path: Path, text: str, what: str) -> None:
    """Make `path` hold `text`, whole or not at all, and durably.

    Written to a temporary file beside it, synced, renamed over it, then the directory
    synced (the rename's own durability). A full disk or quota raises
    ResourceExhausted naming `what` (the disk the volumes share can fill: that is
    not the agent's fault); any failure leaves `path` as it was and no temporary file.
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        tmp.replace(path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if exc.errno in _FULL:
            raise ResourceExhausted(f"no space left to save {what}: {exc.strerror}") from None
        raise
    with contextlib.suppress(OSError):  # the file is replaced; this only hastens it
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

"""The one table of job kinds: what each reads and writes, what it needs, what it returns.

Everything that knows about job kinds derives from `KINDS`: the capsule codec (which
SUBMIT fields a kind may set), the agent's admission checks and runners, the gRPC
converters (`JobSpec` oneof field = `Kind.field`, the same number as the kind), and
the SDK. Adding a kind is one row here plus its runner in the agent.

A row says, for one kind:

- `source` / `destination`: whether it READs host memory (the SUBMIT's source span)
  and WRITEs host memory (the destination span). A span a kind does not use must be
  all zero.
- `handle`: what the SUBMIT's `handle` field names: nothing (must be 0), an attached
  volume, a codec, or a registered key.
- `offset` / `length`: whether the SUBMIT's `offset` (a byte offset in the volume) and
  `length` (bytes to trim) fields are used; unused ones must be 0.
- `flags`: the SUBMIT flag bits of the kind's own (FUA for VOLUME_WRITE only); every kind
  that reads a source also takes INLINE (`accepted_flags`).
- `result`: what the completion's `result` carries.
- `compute`: CPU-heavy work the agent runs on worker threads, overlapped with I/O.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Final


class JobKind(enum.IntEnum):
    """Job kinds: the SUBMIT capsule's `kind` and the number of `JobSpec`'s oneof field."""

    COPY = 1
    CRC32C = 2
    VOLUME_WRITE = 3
    VOLUME_READ = 4
    VOLUME_FLUSH = 5
    VOLUME_TRIM = 6
    SHA256 = 7
    COMPRESS = 8
    DECOMPRESS = 9
    ENCRYPT = 10
    DECRYPT = 11


class Handle(enum.Enum):
    """What the SUBMIT's 32-bit `handle` field names for a kind."""

    NONE = "none"  # must be 0
    VOLUME = "volume"  # an AttachVolume handle
    CODEC = "codec"  # 1 LZ4 frame, 2 Zstandard frame
    KEY = "key"  # a RegisterKey handle


class Result(enum.Enum):
    """What the completion's 64-bit `result` carries when the job succeeded."""

    NONE = "none"  # 0
    CRC32C = "crc32c"  # the CRC-32C in the low 32 bits
    OUTPUT_SIZE = "output size"  # bytes WRITTEN to the start of the destination


FLAG_FUA: Final = 0x0001
"""SUBMIT flag: a VOLUME_WRITE is on stable storage before its completion."""
FLAG_INLINE: Final = 0x0002
"""SUBMIT flag: the source's bytes follow the 80-byte SUBMIT (docs/data-plane.md 2.8)."""

SHA256_BYTES: Final = 32

CODECS: Final = {1: "lz4", 2: "zstd"}
"""COMPRESS/DECOMPRESS handle values: codec number -> name."""


@dataclasses.dataclass(frozen=True)
class Kind:
    """One row of the table (see the module docstring)."""

    kind: JobKind
    field: str  # the JobSpec oneof field, and the SDK's name for the kind
    source: bool
    destination: bool
    handle: Handle = Handle.NONE
    offset: bool = False
    length: bool = False
    flags: int = 0
    result: Result = Result.NONE
    compute: bool = False
    same_length: bool = False  # destination.length must equal source.length
    min_destination: int = 1  # the least destination.length (when it has one)

    @property
    def accepted_flags(self) -> int:
        """The SUBMIT flag bits this kind takes: its own, and INLINE if it reads a source."""
        return self.flags | (FLAG_INLINE if self.source else 0)

    @property
    def volume(self) -> bool:
        """Whether the kind acts on an attached volume."""
        return self.handle is Handle.VOLUME


KINDS: Final[dict[JobKind, Kind]] = {
    row.kind: row
    for row in (
        Kind(JobKind.COPY, "copy", source=True, destination=True, same_length=True),
        Kind(JobKind.CRC32C, "crc32c", source=True, destination=False, result=Result.CRC32C),
        Kind(
            JobKind.VOLUME_WRITE,
            "volume_write",
            source=True,
            destination=False,
            handle=Handle.VOLUME,
            offset=True,
            flags=FLAG_FUA,
        ),
        Kind(
            JobKind.VOLUME_READ,
            "volume_read",
            source=False,
            destination=True,
            handle=Handle.VOLUME,
            offset=True,
        ),
        Kind(
            JobKind.VOLUME_FLUSH,
            "volume_flush",
            source=False,
            destination=False,
            handle=Handle.VOLUME,
        ),
        Kind(
            JobKind.VOLUME_TRIM,
            "volume_trim",
            source=False,
            destination=False,
            handle=Handle.VOLUME,
            offset=True,
            length=True,
        ),
        Kind(
            JobKind.SHA256,
            "sha256",
            source=True,
            destination=True,
            result=Result.OUTPUT_SIZE,
            compute=True,
            min_destination=SHA256_BYTES,
        ),
        Kind(
            JobKind.COMPRESS,
            "compress",
            source=True,
            destination=True,
            handle=Handle.CODEC,
            result=Result.OUTPUT_SIZE,
            compute=True,
        ),
        Kind(
            JobKind.DECOMPRESS,
            "decompress",
            source=True,
            destination=True,
            handle=Handle.CODEC,
            result=Result.OUTPUT_SIZE,
            compute=True,
        ),
        Kind(
            JobKind.ENCRYPT,
            "encrypt",
            source=True,
            destination=True,
            handle=Handle.KEY,
            result=Result.OUTPUT_SIZE,
            compute=True,
        ),
        Kind(
            JobKind.DECRYPT,
            "decrypt",
            source=True,
            destination=True,
            handle=Handle.KEY,
            result=Result.OUTPUT_SIZE,
            compute=True,
        ),
    )
}
assert set(KINDS) == set(JobKind)  # noqa: S101 - every kind has a row, checked at import

BY_FIELD: Final[dict[str, Kind]] = {row.field: row for row in KINDS.values()}
"""Rows by their JobSpec field name ("copy", "volume_write", ...)."""

VOLUME_KINDS: Final = frozenset(k for k, row in KINDS.items() if row.volume)
COMPUTE_KINDS: Final = frozenset(k for k, row in KINDS.items() if row.compute)

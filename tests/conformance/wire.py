"""The data plane's byte layouts, written from docs/data-plane.md alone.

An independent implementation: nothing here imports `dpu_wire`, so the conformance
suite does not check the agent against the agent's own codec. Capsules (section 2) and
tcp frames (section 3), packed with every field settable (the suite sends wrong ones
on purpose), and a strict COMPLETION parser that enforces DP-2.4-1.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from typing import Final, NamedTuple

HEADER: Final = struct.Struct("<2sBBIQ")  # magic, version, opcode, length, job_id
SUBMIT: Final = struct.Struct("<2sBBIQ HHI QII QII Q II Q")
COMPLETION: Final = struct.Struct("<2sBBIQ HBBHH QQQ QQQ Q")
FRAME: Final = struct.Struct("<BBHIQII")  # type, status, reserved, req_id, addr, rkey, length
MAGIC: Final = b"DC"
MAX_CAPSULE: Final = 256
MAX_MESSAGE: Final = 176
AGENT_IDS: Final = 1 << 63
TOKEN_BYTES: Final = 32
assert HEADER.size == 16
assert SUBMIT.size == COMPLETION.size == 80
assert FRAME.size == 24


class Op(enum.IntEnum):
    SUBMIT = 1
    CANCEL = 2
    COMPLETION = 3


class Kind(enum.IntEnum):
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


class St(enum.IntEnum):
    """Completion states."""

    SUCCEEDED = 3
    FAILED = 4
    CANCELLED = 5


class Ft(enum.IntEnum):
    """tcp frame types."""

    CAPSULE = 1
    READ = 2
    READ_RESP = 3
    WRITE = 4
    WRITE_ACK = 5
    HELLO = 6


FUA: Final = 1
INLINE: Final = 2
LZ4: Final = 1
ZSTD: Final = 2


class Span(NamedTuple):
    addr: int = 0
    length: int = 0
    rkey: int = 0


ZERO: Final = Span()


def submit(
    job_id: int,
    kind: int,
    source: Span = ZERO,
    destination: Span = ZERO,
    /,
    *,
    deadline_ms: int = 0,
    flags: int = 0,
    offset: int = 0,
    handle: int = 0,
    reserved: int = 0,
    length: int = 0,
    version: int = 1,
) -> bytes:
    """An 80-byte SUBMIT (any field may be set wrong on purpose)."""
    return SUBMIT.pack(
        MAGIC, version, Op.SUBMIT, 80, job_id, kind, flags, deadline_ms,
        *source, *destination, offset, handle, reserved, length,
    )  # fmt: skip


def submit_inline(
    job_id: int,
    kind: int,
    data: bytes,
    destination: Span = ZERO,
    /,
    *,
    source: Span | None = None,
    extra: bytes = b"",
    **fields: int,
) -> bytes:
    """An INLINE SUBMIT (section 2.8): 80 bytes, then `data`; its header counts both.

    `source` overrides the span (addr 0, len(data), rkey 0); `extra` is sent after `data`
    without being counted in source.length (but in the header's length).
    """
    span = source if source is not None else Span(0, len(data), 0)
    head = submit(job_id, kind, span, destination, flags=INLINE | fields.pop("flags", 0), **fields)
    body = data + extra
    return head[:4] + (80 + len(body)).to_bytes(4, "little") + head[8:] + body


def cancel(job_id: int) -> bytes:
    """A 16-byte CANCEL."""
    return HEADER.pack(MAGIC, 1, Op.CANCEL, 16, job_id)


def completion_bytes(
    job_id: int, state: int = St.SUCCEEDED, status: int = 0, message: bytes = b""
) -> bytes:
    """A well-formed COMPLETION (hosts must not send one)."""
    return (
        COMPLETION.pack(
            MAGIC, 1, Op.COMPLETION, 80 + len(message), job_id, status, state, 0,
            len(message), 0, 0, 0, 0, 0, 0, 0, 0,
        )
        + message
    )  # fmt: skip


class SpecViolation(AssertionError):
    """What the agent sent breaks a requirement of the spec."""


@dataclasses.dataclass(frozen=True)
class Completion:
    job_id: int
    status: int
    state: int
    bytes_read: int
    bytes_written: int
    result: int
    submit_ns: int
    start_ns: int
    end_ns: int
    message: str

    @property
    def ok(self) -> bool:
        return self.state == St.SUCCEEDED


def parse_completion(data: bytes) -> Completion:
    """Parse a capsule the agent sent; SpecViolation unless it is a valid COMPLETION.

    Checks DP-2.4-1: the header, length = 80 + msg_len, msg_len <= 176, whole UTF-8,
    flags and reserved 0, state and status consistent, result 0 unless SUCCEEDED.
    """
    if len(data) < COMPLETION.size:
        raise SpecViolation(f"a capsule from the agent of {len(data)} bytes: {data.hex()}")
    f = COMPLETION.unpack_from(data)
    magic, version, opcode, length, job_id, status, state, flags, msg_len, reserved0 = f[:10]
    problems = []
    if (magic, version, opcode) != (MAGIC, 1, Op.COMPLETION):
        problems.append(f"header magic {magic!r} version {version} opcode {opcode}")
    if length != len(data) or msg_len > MAX_MESSAGE or 80 + msg_len != len(data):
        problems.append(f"length {length}, msg_len {msg_len}, {len(data)} bytes")
    if flags or reserved0 or f[16]:
        problems.append(f"flags {flags}, reserved {reserved0}, {f[16]}")
    if not _STATUS_OF.get(state, lambda _: False)(status):
        problems.append(f"state {state} with status {status}")
    if state != St.SUCCEEDED and f[12]:
        problems.append(f"result {f[12]} in a job that did not succeed")
    try:
        message = bytes(data[80:]).decode("utf-8")
    except UnicodeDecodeError:
        problems.append("message is not whole UTF-8")
        message = ""
    if problems:
        raise SpecViolation(f"COMPLETION of job {job_id}: {'; '.join(problems)}")
    b_read, b_written, result, t_submit, t_start, t_end = f[10:16]
    return Completion(
        job_id, status, state, b_read, b_written, result, t_submit, t_start, t_end, message
    )


_STATUS_OF: Final = {  # state -> which statuses go with it
    St.SUCCEEDED: lambda status: status == 0,
    St.FAILED: lambda status: status != 0,
    St.CANCELLED: lambda status: status == 1,
}


class Frame(NamedTuple):
    type: int
    status: int = 0
    reserved: int = 0
    req_id: int = 0
    addr: int = 0
    rkey: int = 0
    length: int = 0


def frame(
    kind: int,
    status: int = 0,
    req_id: int = 0,
    addr: int = 0,
    rkey: int = 0,
    length: int = 0,
    reserved: int = 0,
) -> bytes:
    """A 24-byte frame header."""
    return FRAME.pack(kind, status, reserved, req_id, addr, rkey, length)


def hello(token: bytes) -> bytes:
    """A HELLO frame: the header and the token."""
    return frame(Ft.HELLO, length=len(token)) + token


def capsule_frame(capsule: bytes) -> bytes:
    """A CAPSULE frame carrying `capsule`."""
    return frame(Ft.CAPSULE, length=len(capsule)) + capsule

"""The job capsule wire format, version 1.

Capsules are the messages of the data plane (one RDMA SEND each, or one frame on
the tcp transport). All integers are little-endian. Every capsule starts with the
same 16-byte header:

    offset size field
    0      2    magic       b"DC"
    2      1    version     1
    3      1    opcode      1 SUBMIT (host→DPU), 2 CANCEL (host→DPU), 3 COMPLETION (DPU→host)
    4      4    length      total capsule length in bytes, header included
    8      8    job_id      chosen by the host, unique among its session's open jobs

SUBMIT (80 bytes; with INLINE, 80 + source.length: the source's bytes follow):

    16     2    kind        1 COPY, 2 CRC32C, 3 VOLUME_WRITE, 4 VOLUME_READ,
                            5 VOLUME_FLUSH, 6 VOLUME_TRIM, 7 SHA256, 8 COMPRESS,
                            9 DECOMPRESS, 10 ENCRYPT (AES-GCM), 11 DECRYPT
    18     2    flags       bit 0 FUA (VOLUME_WRITE only: durable before completion);
                            bit 1 INLINE (kinds with a source: its bytes follow, the
                            span's addr and rkey are 0); other bits reserved, rejected
    20     4    deadline_ms time allowed from receipt to completion, 0 = agent default
    24     16   source      span: addr u64, length u32, rkey u32 (host memory READ)
    40     16   destination span (host memory WRITTEN; zero for kinds without output)
    56     8    offset      volume kinds: byte offset in the volume; else 0
    64     4    handle      volume kinds: the handle AttachVolume gave the session;
                            COMPRESS/DECOMPRESS: format 1 LZ4 frame, 2 Zstandard frame;
                            ENCRYPT/DECRYPT: the handle RegisterKey gave; else 0
    68     4    reserved    0
    72     8    length      VOLUME_TRIM: bytes to trim; else 0

CANCEL (16 bytes): the header alone; job_id names the job to cancel.

COMPLETION (80 bytes + message, at most `MAX_CAPSULE` bytes):

    16     2    status      gRPC status code (0 OK)
    18     1    state       3 SUCCEEDED, 4 FAILED, 5 CANCELLED (dpu.v1.JobState)
    19     1    flags       0
    20     2    msg_len     length of the UTF-8 message after the fixed part
    22     2    reserved    0
    24     8    bytes_read      bytes the agent RDMA-READ from host memory
    32     8    bytes_written   bytes the agent RDMA-WROTE into host memory
    40     8    result      CRC32C: the checksum in the low 32 bits; SHA256, COMPRESS,
                            DECOMPRESS, ENCRYPT, DECRYPT: the output's size in bytes
    48     8    submit_ns   agent clock (CLOCK_REALTIME ns) when the capsule arrived
    56     8    start_ns    ... when the job started
    64     8    end_ns      ... when it finished
    72     8    reserved    0
    80     n    message     error text, n = msg_len ≤ MAX_MESSAGE
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from typing import Final, NamedTuple

from dpu_wire.jobkinds import FLAG_FUA, FLAG_INLINE, KINDS, VOLUME_KINDS, JobKind

__all__ = [
    "AGENT_JOB_ID_BASE",
    "CANCEL_SIZE",
    "COMPLETION_BODY",
    "COMPLETION_FIXED",
    "FLAG_FUA",
    "FLAG_INLINE",
    "HEADER",
    "MAGIC",
    "MAX_CAPSULE",
    "MAX_INLINE",
    "MAX_MESSAGE",
    "SUBMIT_BODY",
    "SUBMIT_SIZE",
    "U32_MAX",
    "U64_MAX",
    "VERSION",
    "VOLUME_KINDS",
    "Cancel",
    "Capsule",
    "CapsuleError",
    "Completion",
    "JobKind",
    "Opcode",
    "Span",
    "State",
    "Submit",
    "decode",
    "pack_completion",
    "peek_header",
]

MAGIC: Final = b"DC"
VERSION: Final = 1
HEADER = struct.Struct("<2sBBIQ")
SUBMIT_BODY = struct.Struct("<HHI QII QII Q II Q")
COMPLETION_BODY = struct.Struct("<HBBHH QQQ QQQ Q")
_SUBMIT = struct.Struct("<2sBBIQ HHI QII QII Q II Q")  # header + body, one unpack
_COMPLETION = struct.Struct("<2sBBIQ HBBHH QQQ QQQ Q")
SUBMIT_SIZE: Final = HEADER.size + SUBMIT_BODY.size
CANCEL_SIZE: Final = HEADER.size
COMPLETION_FIXED: Final = HEADER.size + COMPLETION_BODY.size
MAX_MESSAGE: Final = 176
MAX_CAPSULE: Final = COMPLETION_FIXED + MAX_MESSAGE  # 256: the size of every receive buffer
MAX_INLINE: Final = 16384
"""The most an agent may offer as a session's `inline_max` (docs/data-plane.md 2.8)."""
AGENT_JOB_ID_BASE: Final = 1 << 63
"""Job ids from here up are the agent's (jobs it received through SubmitJob); hosts
number their capsule jobs below it."""
U32_MAX: Final = 0xFFFF_FFFF
U64_MAX: Final = 0xFFFF_FFFF_FFFF_FFFF

assert HEADER.size == 16  # noqa: S101 - layout guards, checked at import
assert SUBMIT_SIZE == 80 == _SUBMIT.size  # noqa: S101
assert COMPLETION_FIXED == 80 == _COMPLETION.size  # noqa: S101
assert MAX_CAPSULE == 256  # noqa: S101


class Opcode(enum.IntEnum):
    """What a capsule is."""

    SUBMIT = 1
    CANCEL = 2
    COMPLETION = 3


class State(enum.IntEnum):
    """Final job states (the numbers of dpu.v1.JobState)."""

    SUCCEEDED = 3
    FAILED = 4
    CANCELLED = 5


class CapsuleError(ValueError):
    """A capsule could not be decoded.

    Attributes:
        job_id: the job id from the header when the header was readable, else 0, so
            the agent can still answer the host with an error completion.
    """

    def __init__(self, message: str, job_id: int = 0) -> None:
        super().__init__(message)
        self.job_id = job_id


class Span(NamedTuple):
    """A window of host memory: virtual address, length and the region's rkey."""

    addr: int = 0
    length: int = 0
    rkey: int = 0

    @property
    def end(self) -> int:
        """One past the last byte (may exceed 2**64 for a bad span; check it)."""
        return self.addr + self.length


ZERO_SPAN: Final = Span()


@dataclasses.dataclass(frozen=True, slots=True)
class Submit:
    """A job the host asks the agent to run."""

    job_id: int
    kind: JobKind
    source: Span
    destination: Span = ZERO_SPAN
    deadline_ms: int = 0
    offset: int = 0
    handle: int = 0
    length: int = 0
    flags: int = 0
    inline: bytes = b""  # with FLAG_INLINE: the source's bytes, sent after the 80

    def encode(self) -> bytes:
        """The SUBMIT capsule: 80 bytes, then the inline source if there is one."""
        return (
            pack_submit(
                self.job_id,
                self.kind,
                self.source,
                self.destination,
                deadline_ms=self.deadline_ms,
                offset=self.offset,
                handle=self.handle,
                length=self.length,
                flags=self.flags,
            )
            + self.inline
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Cancel:
    """The host asks the agent to cancel one of its jobs."""

    job_id: int

    def encode(self) -> bytes:
        """The 16-byte CANCEL capsule."""
        _check_u64(self.job_id, "job_id")
        return HEADER.pack(MAGIC, VERSION, Opcode.CANCEL, CANCEL_SIZE, self.job_id)


@dataclasses.dataclass(frozen=True, slots=True)
class Completion:
    """The agent's answer to one job, sent exactly once per job."""

    job_id: int
    state: State
    status: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    result: int = 0
    submit_ns: int = 0
    start_ns: int = 0
    end_ns: int = 0
    message: str = ""

    def encode(self) -> bytes:
        """The COMPLETION capsule; a long message is cut to MAX_MESSAGE bytes."""
        return pack_completion(
            self.job_id,
            self.state,
            self.status,
            self.bytes_read,
            self.bytes_written,
            self.result,
            self.submit_ns,
            self.start_ns,
            self.end_ns,
            self.message,
        )


Capsule = Submit | Cancel | Completion


# ---------------------------------------------------------------- encoders


def pack_submit(  # noqa: PLR0913 - the SUBMIT's fields
    job_id: int,
    kind: int,
    source: Span,
    destination: Span = ZERO_SPAN,
    *,
    deadline_ms: int = 0,
    offset: int = 0,
    handle: int = 0,
    length: int = 0,
    flags: int = 0,
) -> bytes:
    """The 80-byte SUBMIT capsule; ValueError names a field that does not fit.

    With FLAG_INLINE the header's length counts the `source.length` bytes that the
    caller sends right behind these 80.
    """
    size = SUBMIT_SIZE + source[1] if flags & FLAG_INLINE else SUBMIT_SIZE
    try:
        return _SUBMIT.pack(
            MAGIC, VERSION, Opcode.SUBMIT, size, job_id,
            kind, flags, deadline_ms,
            source[0], source[1], source[2],
            destination[0], destination[1], destination[2],
            offset, handle, 0, length,
        )  # fmt: skip
    except struct.error:
        _check_u64(job_id, "job_id")
        _check_u32(deadline_ms, "deadline_ms")
        _check_u64(offset, "offset")
        _check_u32(handle, "handle")
        _check_u64(length, "length")
        if not 0 <= flags <= 0xFFFF:
            raise ValueError(f"flags {flags} do not fit in 16 bits") from None
        if not 0 <= kind <= 0xFFFF:
            raise ValueError(f"kind {kind} does not fit in 16 bits") from None
        for name, span in (("source", source), ("destination", destination)):
            _check_u64(span[0], f"{name}.addr")
            _check_u32(span[1], f"{name}.length")
            _check_u32(span[2], f"{name}.rkey")
        raise


def pack_completion(  # noqa: PLR0913, PLR0917 - the COMPLETION's fields, positional: hot path
    job_id: int,
    state: int,
    status: int,
    bytes_read: int,
    bytes_written: int,
    result: int,
    submit_ns: int,
    start_ns: int,
    end_ns: int,
    message: str = "",
) -> bytes:
    """The COMPLETION capsule; a long message is cut to MAX_MESSAGE bytes."""
    text = b""
    if message:
        text = message.encode("utf-8", errors="replace")[:MAX_MESSAGE]
        text = text.decode("utf-8", errors="ignore").encode()  # do not split a character
    return (
        _COMPLETION.pack(
            MAGIC,
            VERSION,
            Opcode.COMPLETION,
            COMPLETION_FIXED + len(text),
            job_id,
            status,
            state,
            0,
            len(text),
            0,
            bytes_read,
            bytes_written,
            result,
            submit_ns,
            start_ns,
            end_ns,
            0,
        )
        + text
    )


# ---------------------------------------------------------------- decoders

SubmitFields = tuple[int, int, int, int, int, int, int, int, int, int, int, int, int]
"""(job_id, kind, flags, deadline_ms, source addr, length, rkey, destination addr,
length, rkey, offset, handle, length) of a valid SUBMIT."""

CompletionFields = tuple[int, int, int, int, int, int, int, int, int, str]
"""(job_id, state, status, bytes_read, bytes_written, result, submit_ns, start_ns,
end_ns, message) of a valid COMPLETION."""


def peek_header(data: bytes | bytearray | memoryview) -> tuple[int, int]:
    """(opcode, job_id) of a capsule whose header is valid; CapsuleError otherwise.

    Valid: at least 16 bytes, the magic, version 1, and a `length` equal to the bytes
    received. The opcode is not checked here (`decode` does).
    """
    if len(data) < HEADER.size:
        raise CapsuleError(
            f"capsule is {len(data)} bytes, shorter than the {HEADER.size}-byte header"
        )
    magic, version, opcode, length, job_id = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CapsuleError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise CapsuleError(
            f"unsupported capsule version {version} (this side speaks {VERSION})", job_id
        )
    if length != len(data):
        raise CapsuleError(f"header says {length} bytes but the capsule has {len(data)}", job_id)
    return opcode, job_id


def submit_fields(data: bytes | bytearray | memoryview) -> SubmitFields:
    """The fields of a SUBMIT capsule (header already known valid), or CapsuleError.

    A SUBMIT is 80 bytes, or 80 + source.length with FLAG_INLINE (the inline source is
    `data[SUBMIT_SIZE:]`).
    """
    size = len(data)
    if size < SUBMIT_SIZE:
        job_id = HEADER.unpack_from(data)[4]
        raise CapsuleError(f"SUBMIT capsule must be {SUBMIT_SIZE} bytes, not {size}", job_id)
    f = _SUBMIT.unpack_from(data)
    job_id, kind, flags = f[4], f[5], f[6]
    expected = SUBMIT_SIZE + f[9] if flags & FLAG_INLINE else SUBMIT_SIZE
    if size != expected:
        what = "80 + source.length (INLINE)" if flags & FLAG_INLINE else str(SUBMIT_SIZE)
        raise CapsuleError(f"SUBMIT capsule must be {what} bytes, not {size}", job_id)
    row = KINDS.get(kind)
    if row is None:
        raise CapsuleError(f"unknown job kind {kind}", job_id)
    if flags & ~row.accepted_flags:
        raise CapsuleError(f"reserved flags are set ({flags & ~row.accepted_flags:#x})", job_id)
    if f[16]:
        raise CapsuleError("the reserved field at offset 68 is not zero", job_id)
    return f[4:16] + f[17:]


def completion_fields(data: bytes | bytearray | memoryview) -> CompletionFields:
    """The fields of a COMPLETION capsule (header already known valid), or CapsuleError."""
    size = len(data)
    job_id = HEADER.unpack_from(data)[4]
    if size < COMPLETION_FIXED:
        raise CapsuleError(
            f"COMPLETION capsule is {size} bytes, shorter than {COMPLETION_FIXED}", job_id
        )
    (_m, _v, _o, _l, _j, status, state, _flags, msg_len, _r1, b_read, b_written, result,
     t_sub, t_start, t_end, _r2) = _COMPLETION.unpack_from(data)  # fmt: skip
    if msg_len > MAX_MESSAGE or COMPLETION_FIXED + msg_len != size:
        raise CapsuleError(f"message length {msg_len} does not fit the capsule", job_id)
    if state not in _STATES:
        raise CapsuleError(f"unknown completion state {state}", job_id)
    message = ""
    if msg_len:
        message = bytes(data[COMPLETION_FIXED:]).decode("utf-8", errors="replace")
    return (job_id, state, status, b_read, b_written, result, t_sub, t_start, t_end, message)


_STATES: Final = frozenset(int(s) for s in State)


def decode(data: bytes | bytearray | memoryview) -> Capsule:
    """Parse one capsule, or raise CapsuleError saying what is wrong with it."""
    opcode, job_id = peek_header(data)
    if opcode == Opcode.SUBMIT:
        f = submit_fields(data)
        return Submit(
            job_id=job_id,
            kind=JobKind(f[1]),
            source=Span(f[4], f[5], f[6]),
            destination=Span(f[7], f[8], f[9]),
            deadline_ms=f[3],
            offset=f[10],
            handle=f[11],
            length=f[12],
            flags=f[2],
            inline=bytes(data[SUBMIT_SIZE:]),
        )
    if opcode == Opcode.CANCEL:
        if len(data) != CANCEL_SIZE:
            raise CapsuleError(
                f"CANCEL capsule must be {CANCEL_SIZE} bytes, not {len(data)}", job_id
            )
        return Cancel(job_id)
    if opcode == Opcode.COMPLETION:
        c = completion_fields(data)
        return Completion(job_id, State(c[1]), *c[2:])
    raise CapsuleError(f"unknown opcode {opcode}", job_id)


def _check_u32(value: int, name: str) -> None:
    if not 0 <= value <= U32_MAX:
        raise ValueError(f"{name} {value} does not fit in 32 bits")


def _check_u64(value: int, name: str) -> None:
    if not 0 <= value <= U64_MAX:
        raise ValueError(f"{name} {value} does not fit in 64 bits")

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

SUBMIT (80 bytes):

    16     2    kind        1 COPY, 2 CRC32C, 3 VOLUME_WRITE, 4 VOLUME_READ,
                            5 VOLUME_FLUSH, 6 VOLUME_TRIM, 7 SHA256, 8 COMPRESS,
                            9 DECOMPRESS, 10 ENCRYPT (AES-GCM), 11 DECRYPT
    18     2    flags       bit 0 FUA (VOLUME_WRITE only: durable before completion);
                            other bits reserved, non-zero is rejected
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
from typing import Final

MAGIC: Final = b"DC"
VERSION: Final = 1
HEADER = struct.Struct("<2sBBIQ")
SUBMIT_BODY = struct.Struct("<HHI QII QII Q II Q")
COMPLETION_BODY = struct.Struct("<HBBHH QQQ QQQ Q")
SUBMIT_SIZE: Final = HEADER.size + SUBMIT_BODY.size
CANCEL_SIZE: Final = HEADER.size
COMPLETION_FIXED: Final = HEADER.size + COMPLETION_BODY.size
MAX_MESSAGE: Final = 176
MAX_CAPSULE: Final = COMPLETION_FIXED + MAX_MESSAGE  # 256: the size of every receive buffer
AGENT_JOB_ID_BASE: Final = 1 << 63
"""Job ids from here up are the agent's (jobs it received through SubmitJob); hosts
number their capsule jobs below it."""
U32_MAX: Final = 0xFFFF_FFFF
U64_MAX: Final = 0xFFFF_FFFF_FFFF_FFFF

assert HEADER.size == 16  # noqa: S101 - layout guards, checked at import
assert SUBMIT_SIZE == 80  # noqa: S101
assert COMPLETION_FIXED == 80  # noqa: S101
assert MAX_CAPSULE == 256  # noqa: S101


class Opcode(enum.IntEnum):
    """What a capsule is."""

    SUBMIT = 1
    CANCEL = 2
    COMPLETION = 3


class JobKind(enum.IntEnum):
    """Job kinds a SUBMIT capsule can carry."""

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


FLAG_FUA: Final = 0x0001
"""SUBMIT flag: a VOLUME_WRITE is on stable storage before its completion."""
VOLUME_KINDS: Final = frozenset(
    {JobKind.VOLUME_WRITE, JobKind.VOLUME_READ, JobKind.VOLUME_FLUSH, JobKind.VOLUME_TRIM}
)


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


@dataclasses.dataclass(frozen=True)
class Span:
    """A window of host memory: virtual address, length and the region's rkey."""

    addr: int = 0
    length: int = 0
    rkey: int = 0

    @property
    def end(self) -> int:
        """One past the last byte (may exceed 2**64 for a bad span; check it)."""
        return self.addr + self.length


@dataclasses.dataclass(frozen=True)
class Submit:
    """A job the host asks the agent to run."""

    job_id: int
    kind: JobKind
    source: Span
    destination: Span = Span()
    deadline_ms: int = 0
    offset: int = 0
    handle: int = 0
    length: int = 0
    flags: int = 0

    def encode(self) -> bytes:
        """The 80-byte SUBMIT capsule."""
        _check_u64(self.job_id, "job_id")
        _check_u32(self.deadline_ms, "deadline_ms")
        _check_u64(self.offset, "offset")
        _check_u32(self.handle, "handle")
        _check_u64(self.length, "length")
        if not 0 <= self.flags <= 0xFFFF:
            raise ValueError(f"flags {self.flags} do not fit in 16 bits")
        for name, span in (("source", self.source), ("destination", self.destination)):
            _check_u64(span.addr, f"{name}.addr")
            _check_u32(span.length, f"{name}.length")
            _check_u32(span.rkey, f"{name}.rkey")
        return HEADER.pack(
            MAGIC, VERSION, Opcode.SUBMIT, SUBMIT_SIZE, self.job_id
        ) + SUBMIT_BODY.pack(
            self.kind,
            self.flags,
            self.deadline_ms,
            self.source.addr,
            self.source.length,
            self.source.rkey,
            self.destination.addr,
            self.destination.length,
            self.destination.rkey,
            self.offset,
            self.handle,
            0,
            self.length,
        )


@dataclasses.dataclass(frozen=True)
class Cancel:
    """The host asks the agent to cancel one of its jobs."""

    job_id: int

    def encode(self) -> bytes:
        """The 16-byte CANCEL capsule."""
        _check_u64(self.job_id, "job_id")
        return HEADER.pack(MAGIC, VERSION, Opcode.CANCEL, CANCEL_SIZE, self.job_id)


@dataclasses.dataclass(frozen=True)
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
        text = self.message.encode("utf-8", errors="replace")[:MAX_MESSAGE]
        text = text.decode("utf-8", errors="ignore").encode()  # do not split a character
        length = COMPLETION_FIXED + len(text)
        header = HEADER.pack(MAGIC, VERSION, Opcode.COMPLETION, length, self.job_id)
        body = COMPLETION_BODY.pack(
            self.status,
            self.state,
            0,
            len(text),
            0,
            self.bytes_read,
            self.bytes_written,
            self.result,
            self.submit_ns,
            self.start_ns,
            self.end_ns,
            0,
        )
        return header + body + text


Capsule = Submit | Cancel | Completion


def decode(data: bytes | bytearray | memoryview) -> Capsule:
    """Parse one capsule, or raise CapsuleError saying what is wrong with it."""
    data = bytes(data)
    if len(data) < HEADER.size:
        raise CapsuleError(
            f"capsule is {len(data)} bytes, shorter than the {HEADER.size}-byte header"
        )
    magic, version, opcode, length, job_id = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CapsuleError(f"bad magic {magic!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise CapsuleError(
            f"unsupported capsule version {version} (this side speaks {VERSION})", job_id
        )
    if length != len(data):
        raise CapsuleError(f"header says {length} bytes but the capsule has {len(data)}", job_id)
    if opcode == Opcode.SUBMIT:
        return _decode_submit(data, job_id)
    if opcode == Opcode.CANCEL:
        if length != CANCEL_SIZE:
            raise CapsuleError(f"CANCEL capsule must be {CANCEL_SIZE} bytes, not {length}", job_id)
        return Cancel(job_id)
    if opcode == Opcode.COMPLETION:
        return _decode_completion(data, job_id)
    raise CapsuleError(f"unknown opcode {opcode}", job_id)


def _decode_submit(data: bytes, job_id: int) -> Submit:
    if len(data) != SUBMIT_SIZE:
        raise CapsuleError(f"SUBMIT capsule must be {SUBMIT_SIZE} bytes, not {len(data)}", job_id)
    fields = SUBMIT_BODY.unpack_from(data, HEADER.size)
    kind, flags, deadline, s_addr, s_len, s_key, d_addr, d_len, d_key = fields[:9]
    offset, handle, reserved, length = fields[9:]
    if kind not in JobKind._value2member_map_:
        raise CapsuleError(f"unknown job kind {kind}", job_id)
    allowed = FLAG_FUA if kind == JobKind.VOLUME_WRITE else 0
    if flags & ~allowed:
        raise CapsuleError(f"reserved flags are set ({flags & ~allowed:#x})", job_id)
    if reserved:
        raise CapsuleError("the reserved field at offset 68 is not zero", job_id)
    return Submit(
        job_id=job_id,
        kind=JobKind(kind),
        source=Span(s_addr, s_len, s_key),
        destination=Span(d_addr, d_len, d_key),
        deadline_ms=deadline,
        offset=offset,
        handle=handle,
        length=length,
        flags=flags,
    )


def _decode_completion(data: bytes, job_id: int) -> Completion:
    if len(data) < COMPLETION_FIXED:
        raise CapsuleError(
            f"COMPLETION capsule is {len(data)} bytes, shorter than {COMPLETION_FIXED}", job_id
        )
    (status, state, _flags, msg_len, _r1, b_read, b_written, result, t_sub, t_start, t_end, _r2) = (
        COMPLETION_BODY.unpack_from(data, HEADER.size)
    )
    if msg_len > MAX_MESSAGE or COMPLETION_FIXED + msg_len != len(data):
        raise CapsuleError(f"message length {msg_len} does not fit the capsule", job_id)
    if state not in State._value2member_map_:
        raise CapsuleError(f"unknown completion state {state}", job_id)
    return Completion(
        job_id=job_id,
        state=State(state),
        status=status,
        bytes_read=b_read,
        bytes_written=b_written,
        result=result,
        submit_ns=t_sub,
        start_ns=t_start,
        end_ns=t_end,
        message=data[COMPLETION_FIXED:].decode("utf-8", errors="replace"),
    )


def _check_u32(value: int, name: str) -> None:
    if not 0 <= value <= U32_MAX:
        raise ValueError(f"{name} {value} does not fit in 32 bits")


def _check_u64(value: int, name: str) -> None:
    if not 0 <= value <= U64_MAX:
        raise ValueError(f"{name} {value} does not fit in 64 bits")

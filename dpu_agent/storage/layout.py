"""The on-disk format of the `file` store (also what the `memory` store keeps in RAM).

Three files, little-endian throughout:

    pool            the data of every volume and snapshot, and the metadata log
    checkpoint.0/1  the metadata as of a point in the log (the newer valid one counts)

pool: 512-byte sectors; sector 0-7 is the header, then 4 KiB chunks. A 4096-byte
block takes a chunk, a 512-byte block a sector of a chunk kept for small blocks, a
log block a chunk. Nothing is ever written over a block that a durable record
still points to (see engine.py).

    pool header (4096 bytes at offset 0; the rest zeros)
    off size
      0    8  magic b"DPUPOOL1"
      8    4  version (1)
     12    4  CRC32C of bytes 0-11

    log block (4096 bytes, one pool chunk; the log is a chain of them)
    off size
      0    4  magic b"DPUL"
      4    2  version (1)
      6    2  payload length (records, at most 4048 bytes)
      8    8  salt: random per run of the store (an "era")
     16    8  previous salt: the salt of the era before, in the first block of an era;
              else equal to salt
     24    8  sequence number of this block (the checkpoint's log_seq, +1 per block)
     32    8  sector of the next block (reserved when this one is written)
     40    4  CRC32C of bytes 0-39 and of the payload
     44    4  zero
     48  ...  payload: records, back to back

    record: type u8, body length u16, body (see the RECORDS table)

    checkpoint header (64 bytes at offset 0, the body follows)
    off size
      0    8  magic b"DPUCKPT1"
      8    4  version (1)
     12    4  zero
     16    8  checkpoint number (the higher valid one wins)
     24    8  body length
     32    8  log_head: sector of the first log block after this checkpoint
     40    8  log_seq: its sequence number
     48    8  log_salt: its salt (or the previous salt of an era's first block)
     56    4  CRC32C of the body
     60    4  CRC32C of bytes 0-59

    checkpoint body: next node number u32, node count u32, then per node a NODE
    struct, its strings, and its map chunks (index u32, then phys int64[256],
    meta uint32[256], crc uint32[256]).

Strings are a u16 length and UTF-8 bytes; the sealed key is a u16 length and bytes.
"""

from __future__ import annotations

import dataclasses
import struct
import sys
from array import array
from typing import TYPE_CHECKING, Final

import crc32c

from dpu_agent.storage.blockmap import CHUNK_BLOCKS, Chunk
from dpu_agent.storage.errors import DataCorruption
from dpu_agent.storage.types import Compression, DataServices, Encryption, QosLimits

if TYPE_CHECKING:
    from collections.abc import Iterator

SECTOR: Final = 512
CHUNK: Final = 4096
SECTORS_PER_CHUNK: Final = CHUNK // SECTOR
FIRST_DATA_CHUNK: Final = 1  # chunk 0 is the pool header

POOL_MAGIC: Final = b"DPUPOOL1"
POOL_HEADER: Final = struct.Struct("<8sI")
LOG_MAGIC: Final = b"DPUL"
LOG_HEADER: Final = struct.Struct("<4sHHQQQQ")  # up to the CRC
LOG_HEADER_BYTES: Final = 48
LOG_PAYLOAD: Final = CHUNK - LOG_HEADER_BYTES
CKPT_MAGIC: Final = b"DPUCKPT1"
CKPT_HEADER: Final = struct.Struct("<8sIIQQQQQI")  # up to the header CRC
CKPT_HEADER_BYTES: Final = 64
VERSION: Final = 1

assert POOL_HEADER.size == 12  # noqa: S101 - layout checked at import
assert array("q").itemsize == 8  # noqa: S101
assert array("I").itemsize == 4  # noqa: S101
assert LOG_HEADER.size == 40  # noqa: S101
assert CKPT_HEADER.size == 60  # noqa: S101

# ------------------------------------------------------------------ records

REC_HEADER: Final = struct.Struct("<BH")
CREATE: Final = 1
DELETE_VOLUME: Final = 2
RESIZE: Final = 3
WRITE: Final = 4
TRIM: Final = 5
SNAPSHOT: Final = 6
DELETE_SNAPSHOT: Final = 7
QOS: Final = 8
BATCH: Final = 9

# type -> (name, fixed part of the body; strings follow where the name says so)
RECORDS: Final = {
    # node, parent snapshot (0: none), size, block size, crc32c, create_ns, 4 QoS limits;
    # then volume id, tenant, compression, encryption, source snapshot id, sealed key
    CREATE: ("create", struct.Struct("<IIQIBQ4Q")),
    DELETE_VOLUME: ("delete volume", struct.Struct("<I")),  # node
    RESIZE: ("resize", struct.Struct("<IQQ")),  # node, size, update_ns
    # node, first block, count; then count x WRITE_ENTRY
    WRITE: ("write", struct.Struct("<IQH")),
    TRIM: ("trim", struct.Struct("<IQQ")),  # node, first block, count
    # volume node, new snapshot node, create_ns; then snapshot id, sealed key
    SNAPSHOT: ("snapshot", struct.Struct("<IIQ")),
    DELETE_SNAPSHOT: ("delete snapshot", struct.Struct("<I")),  # node
    QOS: ("qos", struct.Struct("<IQ4Q")),  # node, update_ns, 4 QoS limits
    # the first record of every log block since 2026-11-27: the sequence number of the
    # first block of the commit (one sync) the block was written in
    BATCH: ("batch", struct.Struct("<Q")),
}
WRITE_ENTRY: Final = struct.Struct("<qII")  # phys sector, meta, crc
BATCH_RECORD_BYTES: Final = REC_HEADER.size + RECORDS[BATCH][1].size
RECORD_ROOM: Final = LOG_PAYLOAD - BATCH_RECORD_BYTES  # for the other records of a block
MAX_WRITE_ENTRIES: Final = (RECORD_ROOM - REC_HEADER.size - RECORDS[WRITE][1].size) // 16
MAX_STRING: Final = 1024
_U16: Final = struct.Struct("<H")


def pack_strings(*values: str | bytes | None) -> bytes:
    """u16-length-prefixed strings (str as UTF-8) or bytes (None as empty)."""
    parts = []
    for value in values:
        raw = b"" if value is None else value.encode() if isinstance(value, str) else value
        if len(raw) > MAX_STRING:
            raise ValueError(f"a metadata string of {len(raw)} bytes is over {MAX_STRING}")
        parts += [_U16.pack(len(raw)), raw]
    return b"".join(parts)


def unpack_strings(body: memoryview | bytes, at: int, count: int) -> tuple[list[bytes], int]:
    """`count` strings from `at`; returns them (as bytes) and the offset after them."""
    found = []
    for _ in range(count):
        if at + 2 > len(body):
            raise DataCorruption("a metadata record is cut short")
        (n,) = _U16.unpack_from(body, at)
        at += 2
        if at + n > len(body):
            raise DataCorruption("a metadata record is cut short")
        found.append(bytes(body[at : at + n]))
        at += n
    return found, at


def record(kind: int, *fields: int, strings: tuple[str | bytes | None, ...] = ()) -> bytes:
    """One record: its header, fixed fields and strings."""
    body = RECORDS[kind][1].pack(*fields) + (pack_strings(*strings) if strings else b"")
    return REC_HEADER.pack(kind, len(body)) + body


def write_record(node: int, first: int, entries: list[tuple[int, int, int]]) -> bytes:
    """A WRITE record (at most MAX_WRITE_ENTRIES entries)."""
    head = RECORDS[WRITE][1].pack(node, first, len(entries))
    pack = WRITE_ENTRY.pack
    body = head + b"".join([pack(*e) for e in entries])
    return REC_HEADER.pack(WRITE, len(body)) + body


def batch_record(first_seq: int) -> bytes:
    """The BATCH record that starts each block of the commit whose first block is `first_seq`."""
    return record(BATCH, first_seq)


def batch_of(payload: memoryview) -> int | None:
    """The first block of the commit a log block was written in (its BATCH record).

    None for a block written before BATCH records existed.
    """
    if len(payload) < BATCH_RECORD_BYTES:
        return None
    kind, length = REC_HEADER.unpack_from(payload, 0)
    if kind != BATCH or length != RECORDS[BATCH][1].size:
        return None
    return int(RECORDS[BATCH][1].unpack_from(payload, REC_HEADER.size)[0])


def records(payload: memoryview | bytes) -> Iterator[tuple[int, memoryview]]:
    """(type, body) of each record in a log block's payload."""
    view = memoryview(payload)
    at = 0
    while at < len(view):
        if at + REC_HEADER.size > len(view):
            raise DataCorruption("a log block ends inside a record header")
        kind, length = REC_HEADER.unpack_from(view, at)
        at += REC_HEADER.size
        if kind not in RECORDS or at + length > len(view):
            raise DataCorruption(f"a log block holds a bad record (type {kind})")
        yield kind, view[at : at + length]
        at += length


def services_of(crc: int, compression: bytes, encryption: bytes) -> DataServices:
    """DataServices from their stored form."""
    try:
        return DataServices(
            bool(crc), Compression(compression.decode()), Encryption(encryption.decode())
        )
    except (ValueError, UnicodeDecodeError):
        raise DataCorruption("the volume metadata names unknown data services") from None


def qos_fields(qos: QosLimits) -> tuple[int, int, int, int]:
    """The four limits in their stored order."""
    return (qos.read_iops, qos.write_iops, qos.read_bytes_per_second, qos.write_bytes_per_second)


# ------------------------------------------------------------------ log blocks


@dataclasses.dataclass(frozen=True)
class LogPosition:
    """Where the next log block goes, and what it carries."""

    head: int  # its pool sector
    seq: int  # its sequence number
    salt: int
    prev_salt: int  # == salt, unless it is the first block of an era


def pack_log_block(salt: int, prev_salt: int, seq: int, next_sector: int, payload: bytes) -> bytes:
    """A whole 4 KiB log block."""
    head = LOG_HEADER.pack(LOG_MAGIC, VERSION, len(payload), salt, prev_salt, seq, next_sector)
    crc = crc32c.crc32c(payload, crc32c.crc32c(head))
    block = head + struct.pack("<II", crc, 0) + payload
    return block + bytes(CHUNK - len(block))


def parse_log_block(raw: bytes) -> tuple[int, int, int, int, memoryview] | None:
    """(salt, prev_salt, seq, next, payload) of a valid log block, else None."""
    if raw[:4] != LOG_MAGIC:
        return None
    _magic, version, length, salt, prev, seq, nxt = LOG_HEADER.unpack_from(raw, 0)
    if version != VERSION or length > LOG_PAYLOAD:
        return None
    (crc,) = struct.unpack_from("<I", raw, 40)
    payload = memoryview(raw)[LOG_HEADER_BYTES : LOG_HEADER_BYTES + length]
    if crc32c.crc32c(payload, crc32c.crc32c(raw[:40])) != crc:
        return None
    return salt, prev, seq, nxt, payload


# ------------------------------------------------------------------ pool header


def pool_header() -> bytes:
    """The pool's first chunk."""
    head = POOL_HEADER.pack(POOL_MAGIC, VERSION)
    return head + struct.pack("<I", crc32c.crc32c(head)) + bytes(CHUNK - len(head) - 4)


def pool_header_valid(raw: bytes) -> bool:
    """True if `raw` starts with a pool header this version reads."""
    if len(raw) < 16 or raw[:8] != POOL_MAGIC:
        return False
    (crc,) = struct.unpack_from("<I", raw, 12)
    _, version = POOL_HEADER.unpack_from(raw, 0)
    return bool(crc == crc32c.crc32c(raw[:12]) and version == VERSION)


# ------------------------------------------------------------------ checkpoints

NODE: Final = struct.Struct("<BIIQQIBQQ4QBI")
# kind (1 volume, 2 snapshot), node, parent (0 none), parent_limit, size, block size,
# crc32c, create_ns, update_ns, 4 QoS limits, cloned, chunk count; then strings: name,
# tenant, compression, encryption, source, sealed key; then the chunks
CHUNK_RECORD: Final = struct.Struct("<I")
CHUNK_BYTES: Final = CHUNK_BLOCKS * 16
_LITTLE: Final = sys.byteorder == "little"


def chunk_bytes(chunk: Chunk) -> list[bytes]:
    """A chunk's three arrays, little-endian."""
    arrays = (chunk.phys, chunk.meta, chunk.crc)
    if _LITTLE:
        return [a.tobytes() for a in arrays]
    out = []
    for a in arrays:  # pragma: no cover - big-endian hosts
        b = a[:]
        b.byteswap()
        out.append(b.tobytes())
    return out


def chunk_from(raw: memoryview) -> Chunk:
    """A chunk from its stored arrays."""
    phys, meta, crc = array("q"), array("I"), array("I")
    phys.frombytes(raw[: CHUNK_BLOCKS * 8])
    meta.frombytes(raw[CHUNK_BLOCKS * 8 : CHUNK_BLOCKS * 12])
    crc.frombytes(raw[CHUNK_BLOCKS * 12 : CHUNK_BLOCKS * 16])
    if not _LITTLE:  # pragma: no cover - big-endian hosts
        for a in (phys, meta, crc):
            a.byteswap()
    return Chunk.from_arrays(phys, meta, crc)


@dataclasses.dataclass(frozen=True)
class CheckpointHeader:
    """What a checkpoint's header says."""

    number: int
    body_len: int
    body_crc: int
    # of the first log block after the checkpoint: its sector, its sequence number, and
    # the salt it names as its predecessor's (`prev_salt`: the era's salt, or the salt of
    # the era before for a checkpoint taken before an era's first block). A position
    # read back has salt == prev_salt: only the predecessor's salt is stored.
    position: LogPosition

    def pack(self) -> bytes:
        """The 64-byte header."""
        pos = self.position
        head = CKPT_HEADER.pack(
            CKPT_MAGIC,
            VERSION,
            0,
            self.number,
            self.body_len,
            pos.head,
            pos.seq,
            pos.prev_salt,
            self.body_crc,
        )
        return head + struct.pack("<I", crc32c.crc32c(head))

    @classmethod
    def parse(cls, raw: bytes) -> CheckpointHeader | None:
        """The header in `raw`, or None if it is not a valid one."""
        if len(raw) < CKPT_HEADER_BYTES or raw[:8] != CKPT_MAGIC:
            return None
        (crc,) = struct.unpack_from("<I", raw, 60)
        if crc != crc32c.crc32c(raw[:60]):
            return None
        _, version, _, number, body_len, head, seq, salt, body_crc = CKPT_HEADER.unpack_from(raw)
        if version != VERSION:
            return None
        return cls(number, body_len, body_crc, LogPosition(head, seq, salt, salt))

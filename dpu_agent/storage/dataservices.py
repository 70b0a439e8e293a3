"""Per-block data services: compression, AES-XTS-256 encryption, end-to-end CRC32C.

Write path of one block (block number `n`, `block_size` bytes):

1. compress (LZ4 block format or a zstd frame); keep the result only if it is shorter
   than the block, else store the block raw (the record's COMPRESSED flag tells);
2. encrypt with AES-XTS-256, tweak = `n` as a 16-byte little-endian number (IEEE
   P1619 data-unit number). XTS needs at least 16 bytes: a shorter compressed payload
   is padded with zeros to 16 before encryption (the record keeps the real length);
3. CRC32C over the bytes stored, kept in the block's record.

A read checks the CRC first, then decrypts and decompresses; any failure raises
DataCorruption naming the volume and block. With `crc32c` off nothing detects a
flipped bit in an uncompressed block: encryption alone does not authenticate
(XTS turns the damage into 16 bytes of garbage), so end-to-end protection needs
`crc32c` on.

The record (length, flags, crc) is the backend's metadata for the block; a block with
no record was never written (or was trimmed) and reads as zeros.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Final

import crc32c
import lz4.block
import zstandard
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from dpu_agent.storage.errors import DataCorruption
from dpu_agent.storage.types import Compression, DataServices, Encryption

if TYPE_CHECKING:
    from collections.abc import Callable

FLAG_COMPRESSED: Final = 0x1
FLAG_ENCRYPTED: Final = 0x2
KNOWN_FLAGS: Final = FLAG_COMPRESSED | FLAG_ENCRYPTED
XTS_MIN_BYTES: Final = 16
ZSTD_LEVEL: Final = 1  # fast; the DPU's Arm cores pay for every level above


@dataclasses.dataclass(frozen=True, slots=True)
class BlockRecord:
    """Metadata of one written block.

    `length` is the payload length (compressed or raw) before any XTS padding;
    `crc` is the CRC32C of the stored bytes, None when the volume has no CRC.
    """

    length: int
    flags: int
    crc: int | None

    @property
    def stored_length(self) -> int:
        """Bytes the block occupies at the start of its slot."""
        if self.flags & FLAG_ENCRYPTED:
            return max(self.length, XTS_MIN_BYTES)
        return self.length


_local = threading.local()  # zstd (de)compressors are not safe to share between threads


def _zstd_compressor() -> zstandard.ZstdCompressor:
    comp: zstandard.ZstdCompressor | None = getattr(_local, "zc", None)
    if comp is None:
        comp = _local.zc = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
    return comp


def _zstd_decompressor() -> zstandard.ZstdDecompressor:
    dec: zstandard.ZstdDecompressor | None = getattr(_local, "zd", None)
    if dec is None:
        dec = _local.zd = zstandard.ZstdDecompressor()
    return dec


def _lz4_compress(data: memoryview, _block_size: int) -> bytes:
    return bytes(lz4.block.compress(data, mode="default", store_size=False))


def _lz4_decompress(data: bytes | memoryview, block_size: int) -> bytes:
    try:
        return bytes(lz4.block.decompress(data, uncompressed_size=block_size))
    except lz4.block.LZ4BlockError as exc:
        raise ValueError(str(exc)) from None


def _zstd_compress(data: memoryview, _block_size: int) -> bytes:
    return _zstd_compressor().compress(data)


def _zstd_decompress(data: bytes | memoryview, block_size: int) -> bytes:
    try:
        return _zstd_decompressor().decompress(data, max_output_size=block_size)
    except zstandard.ZstdError as exc:
        raise ValueError(str(exc)) from None


_CODECS: Final[
    dict[
        Compression,
        tuple[Callable[[memoryview, int], bytes], Callable[[bytes | memoryview, int], bytes]],
    ]
] = {
    Compression.LZ4: (_lz4_compress, _lz4_decompress),
    Compression.ZSTD: (_zstd_compress, _zstd_decompress),
}


def _tweak(block: int) -> bytes:
    return block.to_bytes(16, "little")


class BlockCodec:
    """Applies a volume's data services to its blocks. Holds the volume key: never printed."""

    __slots__ = ("_aes", "_block_size", "_codec", "_crc", "_raw", "_volume_id")

    def __init__(
        self, volume_id: str, services: DataServices, block_size: int, key: bytes | None
    ) -> None:
        self._volume_id = volume_id
        self._block_size = block_size
        self._crc = services.crc32c
        self._codec = _CODECS.get(services.compression)
        self._aes: algorithms.AES | None = None
        if services.encryption is Encryption.AES_XTS_256:
            if key is None:
                raise ValueError("an encrypted volume needs its key")
            self._aes = algorithms.AES(key)
        self._raw = BlockRecord(block_size, 0, None)  # the record of every block without services

    def __repr__(self) -> str:
        return f"BlockCodec({self._volume_id!r}, <key hidden>)"

    @property
    def raw_record(self) -> BlockRecord:
        """The record of a block stored as given (a transparent codec's only record)."""
        return self._raw

    @property
    def stores_plain(self) -> bool:
        """True if blocks are stored as given, with at most a CRC beside them."""
        return self._codec is None and self._aes is None

    @property
    def transparent(self) -> bool:
        """True if blocks are stored as given (no compression, encryption or CRC)."""
        return self._codec is None and self._aes is None and not self._crc

    def encode(self, block: int, data: memoryview) -> tuple[bytes | memoryview, BlockRecord]:
        """The bytes to store for one block of data, and the block's record."""
        payload: bytes | memoryview = data
        flags = 0
        if self._codec is not None:
            packed = self._codec[0](data, self._block_size)
            if len(packed) < self._block_size:
                payload, flags = packed, FLAG_COMPRESSED
        length = len(payload)
        if self._aes is not None:
            if length < XTS_MIN_BYTES:
                payload = bytes(payload) + bytes(XTS_MIN_BYTES - length)
            enc = Cipher(self._aes, modes.XTS(_tweak(block))).encryptor()
            payload = enc.update(payload) + enc.finalize()
            flags |= FLAG_ENCRYPTED
        if not flags and not self._crc:
            return payload, self._raw
        crc = crc32c.crc32c(payload) if self._crc else None
        return payload, BlockRecord(length, flags, crc)

    def decode(self, block: int, slot: memoryview, record: BlockRecord) -> bytes | memoryview:
        """The block's data from its slot (`block_size` bytes read from the device).

        Raises DataCorruption if the record is inconsistent, the CRC does not match,
        or the payload does not decompress to exactly one block.
        """
        self._check_record(block, record)
        stored = slot[: record.stored_length]
        if self._crc:
            computed = crc32c.crc32c(stored)
            if computed != record.crc:
                raise self._corrupt(
                    block,
                    f"failed its CRC32C check (stored {record.crc or 0:08x},"
                    f" computed {computed:08x})",
                )
        payload: bytes | memoryview = stored
        if self._aes is not None:
            dec = Cipher(self._aes, modes.XTS(_tweak(block))).decryptor()
            payload = (dec.update(stored) + dec.finalize())[: record.length]
        if record.flags & FLAG_COMPRESSED and self._codec is not None:  # checked: both or none
            try:
                data = self._codec[1](payload, self._block_size)
            except ValueError:
                raise self._corrupt(block, "cannot be decompressed") from None
            if len(data) != self._block_size:
                raise self._corrupt(block, f"decompressed to {len(data)} bytes")
            return data
        return payload

    def _check_record(self, block: int, record: BlockRecord) -> None:
        flags = record.flags
        if flags & ~KNOWN_FLAGS:
            raise self._corrupt(block, f"has unknown flags {flags:#x}")
        if bool(flags & FLAG_ENCRYPTED) != (self._aes is not None):
            raise self._corrupt(block, "is recorded with the wrong encryption setting")
        if flags & FLAG_COMPRESSED and self._codec is None:
            raise self._corrupt(block, "is recorded as compressed on a volume without compression")
        compressed = bool(flags & FLAG_COMPRESSED)
        if not (
            0 < record.length < self._block_size
            if compressed
            else record.length == self._block_size
        ):
            raise self._corrupt(block, f"has a record of impossible length {record.length}")
        if self._crc and record.crc is None:
            raise self._corrupt(block, "has no CRC32C on a volume that checks them")

    def _corrupt(self, block: int, what: str) -> DataCorruption:
        return DataCorruption(f"volume {self._volume_id!r}: block {block} {what}")

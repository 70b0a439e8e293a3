"""Value types of the volume store: data services, volume descriptions, statistics.

All are immutable. None of them ever holds an encryption key.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Final

from dpu_agent.auth import DEFAULT_TENANT

U64_MASK: Final = (1 << 64) - 1

BLOCK_SIZES: Final = (512, 4096)


class Compression(enum.StrEnum):
    """Per-block compression, applied before encryption."""

    NONE = "none"
    LZ4 = "lz4"
    ZSTD = "zstd"


class Encryption(enum.StrEnum):
    """Per-block encryption at rest."""

    NONE = "none"
    AES_XTS_256 = "aes-xts-256"  # 64-byte key, tweak = block number


@dataclasses.dataclass(frozen=True)
class DataServices:
    """Data services of a volume, chosen at creation and immutable afterwards.

    On write each block is compressed (kept only if it shrinks), then encrypted, then
    a CRC32C is taken over the bytes stored; reads reverse it. End-to-end protection
    needs `crc32c=True`: without it a corrupted encrypted block decrypts to garbage
    that nothing can tell from data.
    """

    crc32c: bool = False
    compression: Compression = Compression.NONE
    encryption: Encryption = Encryption.NONE

    @property
    def any(self) -> bool:
        """True if at least one service is on."""
        return (
            self.crc32c
            or self.compression is not Compression.NONE
            or self.encryption is not Encryption.NONE
        )


@dataclasses.dataclass(frozen=True)
class QosLimits:
    """Per-volume I/O limits, enforced by token buckets on the DPU; 0 = no limit.

    An operation is one read or write of at most `[dataplane] chunk_size` bytes: a
    data-plane job counts one per chunk it moves (a 4 MiB write job, four at 1 MiB), a
    block function's device one per request; bytes count their length.
    """

    read_iops: int = 0
    write_iops: int = 0
    read_bytes_per_second: int = 0
    write_bytes_per_second: int = 0

    @property
    def any(self) -> bool:
        """True if at least one limit is set."""
        return bool(
            self.read_iops
            or self.write_iops
            or self.read_bytes_per_second
            or self.write_bytes_per_second
        )


NO_QOS: Final = QosLimits()


@dataclasses.dataclass(frozen=True)
class VolumeInfo:
    """What the store tells about a volume. Never carries its key."""

    volume_id: str
    size_bytes: int
    block_size: int
    services: DataServices
    create_ns: int  # wall clock, ns since the epoch
    update_ns: int  # last change of size or settings
    tenant: str = DEFAULT_TENANT  # the owner (volumes made before tenants: "default")
    qos: QosLimits = NO_QOS
    source_snapshot: str = ""  # a clone: the id of the snapshot it was made from

    @property
    def blocks(self) -> int:
        """Number of blocks in the volume."""
        return self.size_bytes // self.block_size


@dataclasses.dataclass(frozen=True)
class SnapshotInfo:
    """A read-only point-in-time image of a volume. Never carries its key.

    `allocated_bytes` is what the snapshot holds on the store: the blocks written to
    its volume before it was taken (and since the snapshot before it), which it keeps
    when the volume overwrites them. `clones` are the volumes made from it.
    """

    snapshot_id: str
    source_volume: str  # the id of the volume it was taken of (kept after that volume goes)
    size_bytes: int
    block_size: int
    services: DataServices
    create_ns: int
    tenant: str
    allocated_bytes: int = 0
    clones: tuple[str, ...] = ()


# Latency histogram bucket upper bounds, in microseconds (inclusive). The last bound
# is 2**64 - 1, so every sample falls in a bucket and bounds and counts have the
# same length (as VolumeStats.latency_bounds_us / latency_counts on the wire).
LATENCY_BOUNDS_US: Final[tuple[int, ...]] = (
    10,
    20,
    50,
    100,
    200,
    500,
    1_000,
    2_000,
    5_000,
    10_000,
    20_000,
    50_000,
    100_000,
    1_000_000,
    U64_MASK,
)


@dataclasses.dataclass(frozen=True)
class VolumeStats:
    """A snapshot of a volume's I/O counters since the store opened it.

    Counters are unsigned 64-bit and wrap. `errors` counts failed read, write, flush
    and trim calls on the volume (bad arguments, CRC mismatches, I/O errors).
    `latency_counts[i]` counts successful reads and writes that took at most
    `latency_bounds_us[i]` microseconds (and more than the bound before it).
    `throttled_ops` counts reads and writes its QoS limits delayed, `throttle_delay_us`
    the delay they were given in total. `allocated_bytes` is a gauge, not a counter:
    the bytes of blocks the volume itself holds now (blocks it shares with a snapshot
    are the snapshot's).
    """

    read_ops: int = 0
    write_ops: int = 0
    read_bytes: int = 0
    write_bytes: int = 0
    errors: int = 0
    latency_bounds_us: tuple[int, ...] = LATENCY_BOUNDS_US
    latency_counts: tuple[int, ...] = (0,) * len(LATENCY_BOUNDS_US)
    throttled_ops: int = 0
    throttle_delay_us: int = 0
    allocated_bytes: int = 0

"""Checks of volume-store arguments, before anything is touched.

Each check raises InvalidArgument with a message that names the value and the rule.
Key material never appears in a message.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from dpu_agent.errors import InvalidArgument, ResourceExhausted
from dpu_agent.storage.types import BLOCK_SIZES, Compression, DataServices, Encryption
from dpu_wire import names

if TYPE_CHECKING:
    from dpu_agent.storage.types import VolumeInfo

U64_MAX: Final = (1 << 64) - 1


def check_volume_id(volume_id: object, what: str = "volume_id") -> str:
    """A volume id is a resource id (`dpu_wire.names.check_id`)."""
    if not isinstance(volume_id, str):
        raise InvalidArgument(f"{what} must be a string, not {type(volume_id).__name__}")
    try:
        return names.check_id(volume_id, what)
    except names.InvalidNameError as exc:
        raise InvalidArgument(str(exc)) from None


def check_snapshot_id(snapshot_id: object) -> str:
    """A snapshot id is a resource id too."""
    return check_volume_id(snapshot_id, "snapshot_id")


def _check_int(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgument(f"{what} must be an integer, not {type(value).__name__}")
    return value


def check_block_size(block_size: object) -> int:
    """Block sizes are 512 or 4096 bytes."""
    block_size = _check_int(block_size, "block_size")
    if block_size not in BLOCK_SIZES:
        raise InvalidArgument(f"block_size {block_size} is not supported (512 or 4096)")
    return block_size


def check_services(services: object) -> DataServices:
    """Data services must be a DataServices with known enum values."""
    if not isinstance(services, DataServices):
        raise InvalidArgument(f"services must be DataServices, not {type(services).__name__}")
    if not isinstance(services.crc32c, bool):
        raise InvalidArgument("services.crc32c must be a bool")
    if not isinstance(services.compression, Compression):
        raise InvalidArgument(f"services.compression {services.compression!r} is not known")
    if not isinstance(services.encryption, Encryption):
        raise InvalidArgument(f"services.encryption {services.encryption!r} is not known")
    return services


def check_size(size_bytes: object, block_size: int, max_volume_bytes: int) -> int:
    """A size is a positive multiple of the block size, within the store's limit."""
    size = _check_int(size_bytes, "size_bytes")
    if size <= 0 or size % block_size:
        raise InvalidArgument(
            f"size_bytes {size} is not a positive multiple of the block size {block_size}"
        )
    if size > max_volume_bytes:
        raise InvalidArgument(
            f"size_bytes {size} is over the store's limit of {max_volume_bytes} bytes per volume"
        )
    return size


def check_fits(size_bytes: int, free_bytes: int) -> None:
    """Policy: a volume (or a growth) may not be larger than the free space right now."""
    if size_bytes > free_bytes:
        raise ResourceExhausted(
            f"volume of {size_bytes} bytes does not fit: {free_bytes} bytes free"
        )


def check_range(info: VolumeInfo, offset: object, length: object) -> tuple[int, int]:
    """An I/O range: aligned whole blocks inside the volume. Returns (first block, count)."""
    return check_range_in(info.size_bytes, info.block_size, offset, length)


def check_range_in(size_bytes: int, bs: int, offset: object, length: object) -> tuple[int, int]:
    """`check_range` for a volume of `size_bytes` in blocks of `bs` bytes."""
    offset = _check_int(offset, "offset")
    length = _check_int(length, "length")
    if offset < 0:
        raise InvalidArgument(f"offset {offset} is negative")
    if length <= 0:
        raise InvalidArgument(f"length {length} is not positive")
    if offset > U64_MAX or length > U64_MAX:
        raise InvalidArgument("offset or length does not fit in 64 bits")
    if offset % bs:
        raise InvalidArgument(f"offset {offset} is not a multiple of the block size {bs}")
    if length % bs:
        raise InvalidArgument(f"length {length} is not a multiple of the block size {bs}")
    if offset + length > size_bytes:
        raise InvalidArgument(
            f"offset {offset} + length {length} is past the end of the volume ({size_bytes} bytes)"
        )
    return offset // bs, length // bs


def as_byte_view(data: object) -> memoryview:
    """The bytes of `data` (bytes, bytearray or a C-contiguous memoryview) as a flat view."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidArgument(f"data must be bytes or a memoryview, not {type(data).__name__}")
    view = memoryview(data)
    if not view.c_contiguous:
        raise InvalidArgument("data must be a contiguous buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view

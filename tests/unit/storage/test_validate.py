"""The argument checks, table by table (the stores call them before touching anything)."""

import pytest

from dpu_agent.errors import InvalidArgument, ResourceExhausted
from dpu_agent.storage import Compression, DataServices, Encryption, VolumeInfo
from dpu_agent.storage.validate import (
    as_byte_view,
    check_block_size,
    check_fits,
    check_range,
    check_services,
    check_size,
    check_volume_id,
)

INFO = VolumeInfo("v", 1 << 20, 4096, DataServices(), 0, 0)


@pytest.mark.parametrize("volume_id", ["v", "vol-1", "a" * 63, "0"])
def test_good_volume_ids(volume_id):
    assert check_volume_id(volume_id) == volume_id


@pytest.mark.parametrize(
    ("volume_id", "message"),
    [
        ("", "volume_id is empty"),
        ("Vol", "not a lowercase DNS label"),
        ("-v", "not a lowercase DNS label"),
        ("v/1", "not a lowercase DNS label"),
        ("a" * 64, "at most 63"),
        (7, "must be a string, not int"),
    ],
)
def test_bad_volume_ids(volume_id, message):
    with pytest.raises(InvalidArgument, match=message):
        check_volume_id(volume_id)


@pytest.mark.parametrize(
    ("block_size", "message"),
    [
        (1024, r"block_size 1024 is not supported \(512 or 4096\)"),
        (0, "block_size 0 is not supported"),
        (True, "must be an integer, not bool"),
        ("4096", "must be an integer, not str"),
    ],
)
def test_bad_block_sizes(block_size, message):
    with pytest.raises(InvalidArgument, match=message):
        check_block_size(block_size)


@pytest.mark.parametrize("block_size", [512, 4096])
def test_good_block_sizes(block_size):
    assert check_block_size(block_size) == block_size


@pytest.mark.parametrize(
    ("size", "block_size", "limit", "error", "message"),
    [
        (
            0,
            4096,
            1 << 30,
            InvalidArgument,
            "size_bytes 0 is not a positive multiple of the block size 4096",
        ),
        (-4096, 4096, 1 << 30, InvalidArgument, "not a positive multiple"),
        (
            1000,
            512,
            1 << 30,
            InvalidArgument,
            "size_bytes 1000 is not a positive multiple of the block size 512",
        ),
        (2 << 30, 4096, 1 << 30, InvalidArgument, "over the store's limit of 1073741824 bytes"),
        (1.5, 4096, 1 << 30, InvalidArgument, "must be an integer, not float"),
    ],
)
def test_bad_sizes(size, block_size, limit, error, message):
    with pytest.raises(error, match=message):
        check_size(size, block_size, limit)


def test_fit_policy_refuses_more_than_free():
    check_fits(100, 100)
    with pytest.raises(ResourceExhausted, match="volume of 101 bytes does not fit: 100 bytes free"):
        check_fits(101, 100)


@pytest.mark.parametrize(
    ("offset", "length", "message"),
    [
        (100, 4096, "offset 100 is not a multiple of the block size 4096"),
        (0, 100, "length 100 is not a multiple of the block size 4096"),
        (-4096, 4096, "offset -4096 is negative"),
        (0, 0, "length 0 is not positive"),
        (0, -4096, "length -4096 is not positive"),
        (1 << 20, 4096, r"past the end of the volume \(1048576 bytes\)"),
        ((1 << 20) - 4096, 8192, r"past the end of the volume \(1048576 bytes\)"),
        (1 << 64, 4096, "does not fit in 64 bits"),
        ((1 << 64) - 4096, 4096, "past the end"),
        (0, 1 << 70, "does not fit in 64 bits"),
        (None, 4096, "offset must be an integer, not NoneType"),
        (0, 4096.0, "length must be an integer, not float"),
    ],
)
def test_bad_ranges(offset, length, message):
    with pytest.raises(InvalidArgument, match=message):
        check_range(INFO, offset, length)


@pytest.mark.parametrize(
    ("offset", "length", "expected"),
    [(0, 4096, (0, 1)), (8192, 16384, (2, 4)), ((1 << 20) - 4096, 4096, (255, 1))],
)
def test_good_ranges(offset, length, expected):
    assert check_range(INFO, offset, length) == expected


@pytest.mark.parametrize(
    ("services", "message"),
    [
        ("crc32c", "services must be DataServices, not str"),
        (DataServices(crc32c=1), "crc32c must be a bool"),  # type: ignore[arg-type]
        (DataServices(compression="gzip"), "compression 'gzip' is not known"),  # type: ignore[arg-type]
        (DataServices(encryption="rot13"), "encryption 'rot13' is not known"),  # type: ignore[arg-type]
    ],
)
def test_bad_services(services, message):
    with pytest.raises(InvalidArgument, match=message):
        check_services(services)


def test_good_services_pass():
    services = DataServices(True, Compression.LZ4, Encryption.AES_XTS_256)
    assert check_services(services) is services


def test_byte_views():
    assert as_byte_view(b"ab").nbytes == 2
    assert as_byte_view(memoryview(bytearray(8)).cast("I")).nbytes == 8
    with pytest.raises(InvalidArgument, match="contiguous"):
        as_byte_view(memoryview(bytearray(8))[::2])
    with pytest.raises(InvalidArgument, match="must be bytes or a memoryview, not str"):
        as_byte_view("text")

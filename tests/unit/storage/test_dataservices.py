"""The per-block codec alone: compression, XTS, CRC32C, and what a damaged block does."""

import functools
import os
import random
from collections.abc import Callable

import crc32c
import pytest

from dpu_agent.storage import Compression, DataCorruption, DataServices, Encryption
from dpu_agent.storage.dataservices import (
    FLAG_COMPRESSED,
    FLAG_ENCRYPTED,
    BlockCodec,
    BlockRecord,
)

from .conftest import ALL_SERVICES, services_id

KEY = bytes(range(64))


def codec(services: DataServices, block_size: int = 4096) -> BlockCodec:
    key = KEY if services.encryption is Encryption.AES_XTS_256 else None
    return BlockCodec("v", services, block_size, key)


@functools.cache
def text_block(size: int) -> bytes:
    """Compressible, not trivially: random words."""
    rng = random.Random(size)  # noqa: S311 - test data, not secrets
    words = [b"alpha ", b"beta ", b"gamma ", b"delta "]
    return b"".join(rng.choices(words, k=size // 4 + 1))[:size]


DATA: dict[str, Callable[[int], bytes]] = {
    "random": os.urandom,
    "zeros": bytes,
    "text": text_block,
}


def slot_of(payload: bytes | memoryview, block_size: int) -> memoryview:
    """The device slot a payload lands in (the rest of the slot is junk)."""
    slot = bytearray(os.urandom(block_size))
    slot[: len(payload)] = payload
    return memoryview(slot)


@pytest.mark.parametrize("services", ALL_SERVICES, ids=services_id)
@pytest.mark.parametrize("block_size", [512, 4096])
@pytest.mark.parametrize("kind", list(DATA))
def test_round_trip(services, block_size, kind):
    c = codec(services, block_size)
    data = DATA[kind](block_size)
    payload, record = c.encode(7, memoryview(data))
    assert len(payload) == record.stored_length <= block_size
    assert bytes(c.decode(7, slot_of(payload, block_size), record)) == data
    compressed = bool(record.flags & FLAG_COMPRESSED)
    if services.compression is Compression.NONE or kind == "random":
        assert not compressed
        assert record.length == block_size
    else:
        assert compressed
        assert record.length < block_size // 2
    assert bool(record.flags & FLAG_ENCRYPTED) == (services.encryption is Encryption.AES_XTS_256)
    if services.crc32c:
        assert record.crc == crc32c.crc32c(bytes(payload))
    else:
        assert record.crc is None
    if services.encryption is Encryption.AES_XTS_256:
        assert data not in bytes(payload)


def test_tiny_compressed_payload_is_padded_for_xts():
    c = codec(DataServices(True, Compression.LZ4, Encryption.AES_XTS_256), 512)
    payload, record = c.encode(0, memoryview(bytes(512)))
    assert record.length < 16
    assert len(payload) == record.stored_length == 16
    assert bytes(c.decode(0, slot_of(payload, 512), record)) == bytes(512)


def test_xts_tweak_is_the_block_number():
    c = codec(DataServices(encryption=Encryption.AES_XTS_256))
    data = memoryview(os.urandom(4096))
    p1, r1 = c.encode(1, data)
    p2, _ = c.encode(2, data)
    assert p1 != p2
    assert bytes(c.decode(1, slot_of(p1, 4096), r1)) == bytes(data)
    assert bytes(c.decode(2, slot_of(p1, 4096), r1)) != bytes(data)


@pytest.mark.parametrize("services", [s for s in ALL_SERVICES if s.crc32c], ids=services_id)
@pytest.mark.parametrize("kind", ["random", "text"])
def test_any_flipped_byte_is_caught_by_the_crc(services, kind):
    c = codec(services)
    payload, record = c.encode(3, memoryview(DATA[kind](4096)))
    rng = random.Random(1)  # noqa: S311 - test data, not secrets
    for at in rng.sample(range(record.stored_length), min(8, record.stored_length)):
        slot = slot_of(payload, 4096)
        slot[at] ^= 1 << rng.randrange(8)
        with pytest.raises(DataCorruption, match=r"volume 'v': block 3 failed its CRC32C check"):
            c.decode(3, slot, record)


@pytest.mark.parametrize(
    "services",
    [s for s in ALL_SERVICES if not s.crc32c and s.compression is not Compression.NONE],
    ids=services_id,
)
def test_without_crc_a_damaged_compressed_block_fails_or_differs(services):
    """Without CRC nothing promises detection: at best decompression fails."""
    c = codec(services)
    data = text_block(4096)
    payload, record = c.encode(0, memoryview(data))
    for at in range(0, record.stored_length, 3):
        slot = slot_of(payload, 4096)
        slot[at] ^= 0xFF
        failure = ""
        try:
            out = c.decode(0, slot, record)
        except DataCorruption as exc:
            failure = str(exc)
        if failure:
            assert "block 0" in failure
        else:
            assert len(out) == 4096  # garbage, or by chance the data: never a crash


@pytest.mark.parametrize(
    ("services", "record", "message"),
    [
        (DataServices(), BlockRecord(4096, 0x8, None), "unknown flags 0x8"),
        (DataServices(), BlockRecord(4096, FLAG_ENCRYPTED, None), "wrong encryption setting"),
        (
            DataServices(encryption=Encryption.AES_XTS_256),
            BlockRecord(4096, 0, None),
            "wrong encryption setting",
        ),
        (DataServices(), BlockRecord(100, FLAG_COMPRESSED, None), "compressed on a volume without"),
        (DataServices(), BlockRecord(100, 0, None), "impossible length 100"),
        (
            DataServices(compression=Compression.LZ4),
            BlockRecord(0, FLAG_COMPRESSED, None),
            "length 0",
        ),
        (
            DataServices(compression=Compression.LZ4),
            BlockRecord(4096, FLAG_COMPRESSED, None),
            "impossible length 4096",
        ),
        (DataServices(crc32c=True), BlockRecord(4096, 0, None), "has no CRC32C"),
        (
            DataServices(compression=Compression.ZSTD),
            BlockRecord(20, FLAG_COMPRESSED, None),
            "cannot be decompressed",
        ),
        (
            DataServices(compression=Compression.LZ4),
            BlockRecord(20, FLAG_COMPRESSED, None),
            "cannot be decompressed",
        ),
    ],
)
def test_impossible_records_are_corruption(services, record, message):
    c = codec(services)
    with pytest.raises(DataCorruption, match=message):
        c.decode(0, memoryview(os.urandom(4096)), record)


def test_codec_repr_hides_the_key():
    c = codec(DataServices(encryption=Encryption.AES_XTS_256))
    assert "key hidden" in repr(c)
    assert KEY.hex() not in repr(c)
    assert repr(KEY) not in repr(c)

"""Reads and writes through both backends, with every combination of data services."""

import functools
import os
import random
import threading

import pytest

from dpu_agent.errors import FailedPrecondition, InvalidArgument, NotFound
from dpu_agent.storage import (
    Compression,
    DataCorruption,
    DataServices,
    Encryption,
    engine,
)

from .conftest import ALL_SERVICES, MiB, flip_stored_byte, make_store, services_id
from .test_dataservices import text_block


@functools.cache
def mixed_data(size: int, seed: int) -> bytes:
    """Random, compressible and zero blocks interleaved (4 KiB granules)."""
    rng = random.Random(seed)  # noqa: S311 - test data, not secrets
    parts = []
    for i in range(0, size, 4096):
        kind = rng.randrange(3)
        n = min(4096, size - i)
        parts.append(rng.randbytes(n) if kind == 0 else text_block(n) if kind == 1 else bytes(n))
    return b"".join(parts)


@pytest.mark.parametrize("services", ALL_SERVICES, ids=services_id)
@pytest.mark.parametrize("block_size", [512, 4096])
def test_write_read_back_every_byte(store, services, block_size):
    """Two volumes per combination; single and multi-block I/O; every byte compared."""
    size = MiB
    model = {v: bytearray(size) for v in ("a", "b")}
    for v in model:
        store.create(v, size, block_size, services)
    rng = random.Random(block_size)  # noqa: S311 - test data, not secrets
    for i in range(24):
        v = "ab"[i % 2]
        blocks = rng.choice([1, 1, 2, 7, 64])
        offset = rng.randrange(size // block_size - blocks + 1) * block_size
        data = mixed_data(blocks * block_size, i) if i % 3 else os.urandom(blocks * block_size)
        store.write(v, offset, memoryview(data) if i % 2 else data, fua=i % 5 == 0)
        model[v][offset : offset + len(data)] = data
        assert store.read(v, offset, len(data)) == data
    for v, expected in model.items():
        assert store.read(v, 0, size) == expected
        for offset in range(0, size, 37 * block_size):
            assert store.read(v, offset, block_size) == expected[offset : offset + block_size]
    store.flush("a")
    assert store.read("a", 0, size) == model["a"]


def test_unwritten_blocks_read_as_zeros(store):
    for i, services in enumerate(ALL_SERVICES):
        store.create(f"v{i}", MiB, 4096, services)
        assert store.read(f"v{i}", 0, MiB) == bytes(MiB)


@pytest.mark.parametrize("services", ALL_SERVICES, ids=services_id)
def test_overwrite_with_other_kinds_of_data(store, services):
    """A block changing between compressible and not keeps reading right."""
    store.create("v", MiB, 4096, services)
    for data in (text_block(8192), os.urandom(8192), bytes(8192), text_block(8192)[::-1]):
        store.write("v", 4096, data)
        assert store.read("v", 0, 16384) == bytes(4096) + data + bytes(4096)


@pytest.mark.parametrize("services", [s for s in ALL_SERVICES if s.crc32c], ids=services_id)
def test_damaged_block_is_detected_with_crc(store, services):
    store.create("v", MiB, 4096, services)
    data = os.urandom(4096) + text_block(4096) + bytes(4096)
    store.write("v", 0, data, fua=True)
    for block in range(3):
        flip_stored_byte(store, "v", block, at=5)
        with pytest.raises(DataCorruption, match=f"volume 'v': block {block} failed its CRC32C"):
            store.read("v", 0, len(data))
        with pytest.raises(DataCorruption):
            store.read("v", block * 4096, 4096)
        flip_stored_byte(store, "v", block, at=5)  # undo
        assert store.read("v", 0, len(data)) == data
    assert store.stats("v").errors == 6


@pytest.mark.parametrize(
    "services",
    [s for s in ALL_SERVICES if not s.crc32c and s.encryption is Encryption.AES_XTS_256],
    ids=services_id,
)
def test_damaged_encrypted_block_without_crc_is_not_protected(store, services):
    """Documented: XTS does not authenticate. Without crc32c, damage reads as garbage
    (or fails to decompress); never a crash, never the wrong length."""
    store.create("v", MiB, 4096, services)
    data = os.urandom(4096) + text_block(4096)
    store.write("v", 0, data, fua=True)
    for block in range(2):
        flip_stored_byte(store, "v", block, at=3)
        try:
            out = store.read("v", block * 4096, 4096)
        except DataCorruption as exc:
            failure = str(exc)
            assert services.compression is not Compression.NONE, failure
            assert f"block {block}" in failure
        else:
            assert len(out) == 4096
            assert out != data[block * 4096 : (block + 1) * 4096]


def test_zero_copy_inputs(store):
    store.create("v", MiB, 512, DataServices(crc32c=True))
    buf = bytearray(os.urandom(4096))
    store.write("v", 512, memoryview(buf)[512:1536])
    assert store.read("v", 512, 1024) == bytes(buf[512:1536])
    store.write("v", 0, memoryview(buf).cast("Q"))  # any format: its bytes
    assert store.read("v", 0, 4096) == bytes(buf)


# (operation, args after the volume id, error, message)
BAD_IO = [
    ("write", (100, 4096), InvalidArgument, "offset 100 is not a multiple of the block size 4096"),
    ("write", (0, 100), InvalidArgument, "length 100 is not a multiple of the block size 4096"),
    ("write", (0, 6000), InvalidArgument, "length 6000 is not a multiple"),
    ("write", (-4096, 4096), InvalidArgument, "offset -4096 is negative"),
    ("write", (0, 0), InvalidArgument, "length 0 is not positive"),
    ("write", (MiB - 4096, 8192), InvalidArgument, r"past the end of the volume \(1048576 bytes\)"),
    ("write", (MiB, 4096), InvalidArgument, r"past the end of the volume \(1048576 bytes\)"),
    ("write", (1 << 64, 4096), InvalidArgument, "does not fit in 64 bits"),
    ("write", ((1 << 64) - 4096, 4096), InvalidArgument, "past the end"),
    ("read", (100, 4096), InvalidArgument, "offset 100 is not a multiple"),
    ("read", (0, 4095), InvalidArgument, "length 4095 is not a multiple"),
    ("read", (0, 0), InvalidArgument, "length 0 is not positive"),
    ("read", (-1, 4096), InvalidArgument, "offset -1 is negative"),
    ("read", (0, 2 * MiB), InvalidArgument, "past the end of the volume"),
    ("read", (1 << 70, 4096), InvalidArgument, "does not fit in 64 bits"),
    ("trim", (512, 4096), InvalidArgument, "offset 512 is not a multiple"),
    ("trim", (0, 0), InvalidArgument, "length 0 is not positive"),
    ("trim", (0, 2 * MiB), InvalidArgument, "past the end"),
]


@pytest.mark.parametrize(("op", "args", "error", "message"), BAD_IO)
def test_bad_io_is_refused_and_changes_nothing(store, op, args, error, message):
    store.create("v", MiB, 4096, DataServices(True, Compression.LZ4, Encryption.AES_XTS_256))
    before = mixed_data(MiB, 1)
    store.write("v", 0, before)
    offset, length = args
    call = {
        "write": lambda: store.write("v", offset, bytes(max(length, 0))),
        "read": lambda: store.read("v", offset, length),
        "trim": lambda: store.trim("v", offset, length),
    }[op]
    with pytest.raises(error, match=message):
        call()
    assert store.read("v", 0, MiB) == before
    assert store.stats("v").errors == 1


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s: s.read("nope", 0, 4096), "volume 'nope' does not exist"),
        (lambda s: s.write("nope", 0, bytes(4096)), "volume 'nope' does not exist"),
        (lambda s: s.trim("nope", 0, 4096), "volume 'nope' does not exist"),
        (lambda s: s.flush("nope"), "volume 'nope' does not exist"),
        (lambda s: s.stats("nope"), "volume 'nope' does not exist"),
        (lambda s: s.get("nope"), "volume 'nope' does not exist"),
        (lambda s: s.resize("nope", MiB), "volume 'nope' does not exist"),
        (lambda s: s.delete("nope"), "volume 'nope' does not exist"),
    ],
)
def test_unknown_volume_is_not_found(store, call, message):
    with pytest.raises(NotFound, match=message):
        call(store)


def test_bad_data_type_is_refused(store):
    store.create("v", MiB, 4096, DataServices())
    with pytest.raises(InvalidArgument, match="data must be bytes or a memoryview, not str"):
        store.write("v", 0, "x" * 4096)
    with pytest.raises(InvalidArgument, match="volume_id"):
        store.read("Bad/Id", 0, 4096)


@pytest.mark.parametrize("services", ALL_SERVICES, ids=services_id)
def test_trim_forgets_blocks(store, services):
    store.create("v", MiB, 4096, services)
    data = mixed_data(64 * 4096, 3)
    store.write("v", 0, data)
    store.flush("v")
    store.write("v", 64 * 4096, data[:8192])  # pending, not flushed: trimmed too
    store.trim("v", 16 * 4096, 50 * 4096)
    expected = data[: 16 * 4096] + bytes(50 * 4096)
    assert store.read("v", 0, 66 * 4096) == expected
    store.write("v", 20 * 4096, data[:4096])
    assert store.read("v", 20 * 4096, 4096) == data[:4096]


def test_io_after_close_is_refused(backend, tmp_path):
    store = make_store(backend, tmp_path)
    store.create("v", MiB, 4096, DataServices())
    store.close()
    store.close()  # harmless
    with pytest.raises(FailedPrecondition, match="closed"):
        store.read("v", 0, 4096)
    with pytest.raises(FailedPrecondition, match="closed"):
        store.list()


def test_threads_on_shared_and_separate_volumes(store):
    services = DataServices(True, Compression.ZSTD, Encryption.AES_XTS_256)
    for v in ("s", "p0", "p1", "p2", "p3"):
        store.create(v, MiB, 4096, services)
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            rng = random.Random(n)  # noqa: S311 - test data, not secrets
            own = f"p{n}"
            for i in range(40):
                data = mixed_data(8192, n * 1000 + i)
                offset = rng.randrange(128) * 8192
                store.write(own, offset, data, fua=i % 10 == 0)
                assert store.read(own, offset, 8192) == data
                # the shared volume: each thread owns every 4th 8 KiB piece
                piece = (rng.randrange(32) * 4 + n) * 8192
                store.write("s", piece, data)
                assert store.read("s", piece, 8192) == data
                if i % 7 == 0:
                    store.flush("s")
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    total = sum(store.stats(f"p{n}").write_ops for n in range(4))
    assert total == 160
    assert store.stats("s").write_ops == 160


def test_a_large_trim_goes_a_slice_at_a_time_and_a_repeat_logs_nothing(tmp_path, monkeypatch):
    """A trim over a snapshot leaves a ZERO marker per block the snapshot holds: each
    slice of the range is one hold of the store's lock and one log record, so other
    volumes' I/O is not stalled for the whole range, and a range already trimmed logs
    nothing. Read back, and after a reopen (the records replayed), as one trim."""
    monkeypatch.setattr(engine, "TRIM_SLICE_BLOCKS", 16)
    data = mixed_data(100 * 4096, 5)
    with make_store("file", tmp_path) as store:
        store.create("v", MiB, 4096, DataServices())
        store.write("v", 0, data)
        store.create_snapshot("v", "s")
        store.write("v", 0, data[: 8 * 4096])  # the volume's own blocks over the snapshot's
        before = store._journal.appended
        store.trim("v", 4096, 99 * 4096)
        assert store._journal.appended - before == 7  # ceil(99 / 16) slices, each changed
        store.trim("v", 4096, 99 * 4096)
        assert store._journal.appended - before == 7  # nothing left to change
        expected = data[:4096] + bytes(99 * 4096)
        assert store.read("v", 0, 100 * 4096) == expected
    with make_store("file", tmp_path) as store:
        assert store.read("v", 0, 100 * 4096) == expected
        store.clone("s", "c")
        assert store.read("c", 0, 100 * 4096) == data  # the snapshot kept its own

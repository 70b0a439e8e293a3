"""Volume lifecycle through both backends: create, get, list, resize, delete, stats."""

import os

import pytest

from dpu_agent.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
)
from dpu_agent.storage import (
    LATENCY_BOUNDS_US,
    Compression,
    DataServices,
    Encryption,
    MemoryVolumeStore,
    VolumeInfo,
    VolumeStats,
    open_store,
)

from .conftest import MiB, make_store

XTS = DataServices(True, Compression.ZSTD, Encryption.AES_XTS_256)


def test_create_describes_the_volume(store):
    info = store.create("vol-1", 2 * MiB, 512, XTS)
    assert isinstance(info, VolumeInfo)
    assert (info.volume_id, info.size_bytes, info.block_size, info.services) == (
        "vol-1",
        2 * MiB,
        512,
        XTS,
    )
    assert info.create_ns == info.update_ns > 0
    assert info.blocks == 4096
    assert store.get("vol-1") == info


# (arguments of create, error, message)
BAD_CREATE = [
    (("Vol", MiB, 4096, DataServices()), InvalidArgument, "not a lowercase DNS label"),
    (("", MiB, 4096, DataServices()), InvalidArgument, "volume_id is empty"),
    (("v", MiB, 1024, DataServices()), InvalidArgument, r"block_size 1024 is not supported"),
    (("v", 0, 4096, DataServices()), InvalidArgument, "not a positive multiple"),
    (
        ("v", MiB + 512, 4096, DataServices()),
        InvalidArgument,
        "not a positive multiple of the block size 4096",
    ),
    (
        ("v", 16 * MiB, 4096, DataServices()),
        InvalidArgument,
        "over the store's limit of 8388608 bytes",
    ),
    (("v", MiB, 4096, "none"), InvalidArgument, "services must be DataServices"),
    (
        ("v", MiB, 4096, DataServices(), b"k" * 64),
        InvalidArgument,
        "key was given for a volume without encryption",
    ),
    (("v", MiB, 4096, XTS, b"k" * 63), InvalidArgument, "^encryption key must be 64 bytes$"),
    (("v", MiB, 4096, XTS, b""), InvalidArgument, "^encryption key must be 64 bytes$"),
    (("v", MiB, 4096, XTS, b"ab" * 32), InvalidArgument, "halves must differ"),
    (("v", MiB, 4096, XTS, "k" * 64), InvalidArgument, "^encryption key must be 64 bytes$"),
]


@pytest.mark.parametrize(("args", "error", "message"), BAD_CREATE)
def test_bad_create_is_refused(backend, tmp_path, args, error, message):
    with make_store(backend, tmp_path, max_volume_bytes=8 * MiB) as store:
        with pytest.raises(error, match=message):
            store.create(*args)
        assert store.list() == []


def test_duplicate_id_is_refused_and_keeps_the_first(store):
    store.create("v", MiB, 4096, DataServices(crc32c=True))
    store.write("v", 0, b"x" * 4096, fua=True)
    with pytest.raises(AlreadyExists, match="volume 'v' already exists"):
        store.create("v", 2 * MiB, 512, XTS)
    assert store.get("v").size_bytes == MiB
    assert store.read("v", 0, 4096) == b"x" * 4096


def test_volume_must_fit_in_free_space(store, monkeypatch):
    monkeypatch.setattr(store, "_free_bytes", lambda: 3 * MiB)
    with pytest.raises(
        ResourceExhausted, match=f"volume of {4 * MiB} bytes does not fit: {3 * MiB} bytes free"
    ):
        store.create("big", 4 * MiB, 4096, DataServices())
    store.create("v", 2 * MiB, 4096, DataServices())
    with pytest.raises(ResourceExhausted, match=f"volume of {4 * MiB} bytes does not fit"):
        store.resize("v", 6 * MiB)  # the growth counts
    assert store.resize("v", 5 * MiB).size_bytes == 5 * MiB
    assert [v.volume_id for v in store.list()] == ["v"]


def test_list_is_sorted_by_id(store):
    for v in ("m", "a", "z9", "b-1", "0"):
        store.create(v, MiB, 4096, DataServices())
    assert [v.volume_id for v in store.list()] == ["0", "a", "b-1", "m", "z9"]


@pytest.mark.parametrize("services", [DataServices(), XTS], ids=["plain", "services"])
def test_resize_grow_keeps_data_and_reads_zeros_beyond(store, services):
    store.create("v", MiB, 4096, services)
    data = os.urandom(MiB)
    store.write("v", 0, data)
    info = store.resize("v", 3 * MiB)
    assert info.size_bytes == 3 * MiB
    assert info.update_ns >= info.create_ns
    assert store.get("v") == info
    assert store.read("v", 0, 3 * MiB) == data + bytes(2 * MiB)
    store.write("v", 2 * MiB, data)
    assert store.read("v", 2 * MiB, MiB) == data


def test_shrink_over_data_needs_force(store):
    store.create("v", 2 * MiB, 4096, XTS)
    data = os.urandom(8192)
    store.write("v", 0, data, fua=True)
    store.write("v", MiB + 4096, data)  # pending
    with pytest.raises(
        FailedPrecondition, match="holds data past 1048576 bytes; shrinking would drop it"
    ):
        store.resize("v", MiB)
    assert store.get("v").size_bytes == 2 * MiB
    assert store.read("v", MiB + 4096, 8192) == data
    store.flush("v")  # committed records count the same
    with pytest.raises(FailedPrecondition, match="use force"):
        store.resize("v", MiB)
    store.resize("v", MiB, force=True)
    assert store.get("v").size_bytes == MiB
    with pytest.raises(InvalidArgument, match="past the end"):
        store.read("v", MiB, 4096)
    store.resize("v", 2 * MiB)  # the dropped blocks come back as zeros
    assert store.read("v", 0, 2 * MiB) == data + bytes(2 * MiB - 8192)


def test_shrink_over_empty_tail_needs_no_force(store):
    store.create("v", 2 * MiB, 4096, DataServices(crc32c=True))
    store.write("v", MiB - 4096, b"y" * 4096)
    store.trim("v", MiB - 4096, 4096)
    store.write("v", 0, b"z" * 4096)
    assert store.resize("v", MiB).size_bytes == MiB
    assert store.read("v", 0, 4096) == b"z" * 4096


@pytest.mark.parametrize(
    ("size", "error", "message"),
    [
        (0, InvalidArgument, "not a positive multiple"),
        (MiB + 100, InvalidArgument, "not a positive multiple of the block size 4096"),
        (64 * MiB, InvalidArgument, "over the store's limit"),
    ],
)
def test_bad_resize_changes_nothing(backend, tmp_path, size, error, message):
    with make_store(backend, tmp_path, max_volume_bytes=8 * MiB) as store:
        store.create("v", MiB, 4096, DataServices())
        store.write("v", 0, b"q" * MiB)
        with pytest.raises(error, match=message):
            store.resize("v", size)
        assert store.get("v").size_bytes == MiB
        assert store.read("v", 0, MiB) == b"q" * MiB


def test_resize_to_same_size_is_a_no_op(store):
    info = store.create("v", MiB, 4096, DataServices())
    assert store.resize("v", MiB) == info


def test_delete_forgets_the_volume_and_its_data(store):
    store.create("v", MiB, 4096, XTS)
    store.write("v", 0, os.urandom(MiB), fua=True)
    store.delete("v")
    assert store.list() == []
    store.create("v", MiB, 4096, XTS)  # the id is free again; nothing of the old one shows
    assert store.read("v", 0, MiB) == bytes(MiB)
    assert store.stats("v").write_ops == 0


def test_stats_count_io_and_errors(store):
    store.create("v", MiB, 4096, DataServices(crc32c=True))
    assert store.stats("v") == VolumeStats()
    store.write("v", 0, bytes(8192))
    store.write("v", 8192, bytes(4096), fua=True)
    store.read("v", 0, 12288)
    with pytest.raises(InvalidArgument):
        store.read("v", 1, 4096)
    with pytest.raises(InvalidArgument):
        store.write("v", 0, bytes(1))
    stats = store.stats("v")
    assert (stats.write_ops, stats.write_bytes) == (2, 12288)
    assert (stats.read_ops, stats.read_bytes) == (1, 12288)
    assert stats.errors == 2
    assert stats.latency_bounds_us == LATENCY_BOUNDS_US
    assert len(stats.latency_counts) == len(stats.latency_bounds_us)
    assert sum(stats.latency_counts) == 3
    assert stats.latency_bounds_us[-1] == (1 << 64) - 1
    assert list(stats.latency_bounds_us) == sorted(stats.latency_bounds_us)


def test_stats_counters_wrap_at_64_bits(store):
    store.create("v", MiB, 4096, DataServices())
    counter = store._volumes["v"].stats
    counter._write_bytes = (1 << 64) - 100
    store.write("v", 0, bytes(4096))
    assert store.stats("v").write_bytes == 4096 - 100


@pytest.mark.parametrize(
    ("backend_name", "error", "message"),
    [
        ("tape", InvalidArgument, "unknown storage backend 'tape'"),
    ],
)
def test_open_store_refuses_unknown_backends(backend_name, error, message):
    with pytest.raises(error, match=message):
        open_store(backend_name)


def test_open_store_by_name(tmp_path):
    with open_store("memory") as store:
        store.create("v", MiB, 4096, DataServices())
    with open_store("file", tmp_path / "s", max_volume_bytes=MiB) as store:
        assert store.create("v", MiB, 4096, DataServices()).size_bytes == MiB
    with pytest.raises(InvalidArgument, match="needs a directory"):
        open_store("file")


def test_memory_store_capacity_bounds_new_volumes():
    with MemoryVolumeStore(capacity_bytes=3 * MiB) as store:
        store.create("v", 2 * MiB, 4096, DataServices())
        store.write("v", 0, os.urandom(2 * MiB))
        with pytest.raises(
            ResourceExhausted, match=rf"volume of {2 * MiB} bytes does not fit: \d+ bytes free"
        ):
            store.create("w", 2 * MiB, 4096, DataServices())
        store.trim("v", 0, 2 * MiB)
        store.create("w", 2 * MiB, 4096, DataServices())

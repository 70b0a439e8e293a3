"""Snapshots and clones through both backends: point in time, shared space, safe deletes."""

import os

import pytest

from dpu_agent.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from dpu_agent.storage import Compression, DataServices, Encryption, FileVolumeStore
from dpu_agent.storage.engine import MAX_CHAIN_DEPTH

from .conftest import ALL_SERVICES, MiB, services_id
from .test_io import mixed_data

XTS = DataServices(True, Compression.LZ4, Encryption.AES_XTS_256)


def used(store) -> int:
    """Chunks of the pool in use (data and log); commits first so frees have landed."""
    store.commit()
    store.commit()
    return int(store._space.used_chunks)


@pytest.mark.parametrize("services", ALL_SERVICES, ids=services_id)
def test_a_snapshot_is_the_volume_at_that_instant(store, services):
    store.create("v", MiB, 4096 if services.crc32c else 512, services)
    before = mixed_data(MiB, 1)
    store.write("v", 0, before)
    snap = store.create_snapshot("v", "s1")
    assert (snap.snapshot_id, snap.source_volume, snap.size_bytes) == ("s1", "v", MiB)
    assert snap.allocated_bytes == MiB
    after = mixed_data(MiB // 2, 2)
    store.write("v", 0, after)
    store.trim("v", MiB - 8192, 8192)
    store.clone("s1", "c1")
    assert store.read("c1", 0, MiB) == before
    assert store.read("v", 0, MiB) == after + before[MiB // 2 : MiB - 8192] + bytes(8192)
    assert store.get("c1").source_snapshot == "s1"
    assert store.get("c1").services == services


def test_snapshots_and_clones_share_space_until_written(store):
    store.create("v", 4 * MiB, 4096, DataServices(crc32c=True))
    store.write("v", 0, os.urandom(4 * MiB), fua=True)
    base = used(store)
    store.create_snapshot("v", "s")
    store.clone("s", "c1")
    store.clone("s", "c2", 8 * MiB)
    assert used(store) - base <= 2  # a few log chunks, no data
    assert store.stats("v").allocated_bytes == 0
    assert store.get_snapshot("s").allocated_bytes == 4 * MiB
    store.write("c1", 0, os.urandom(MiB))
    assert store.stats("c1").allocated_bytes == MiB
    assert used(store) - base <= 256 + 4
    assert store.read("c2", 4 * MiB, 4 * MiB) == bytes(4 * MiB)  # grown: zeros past the snapshot
    assert store.get_snapshot("s").clones == ("c1", "c2")


def test_deletes_free_only_what_nothing_references(store):
    store.create("v", MiB, 4096, DataServices())
    base = used(store)
    data = os.urandom(MiB)
    store.write("v", 0, data, fua=True)
    store.create_snapshot("v", "s")
    store.write("v", 0, b"n" * 65536, fua=True)  # 16 blocks now differ from the snapshot
    store.delete("v")  # frees its 16 blocks; the snapshot keeps its 256
    assert 256 <= used(store) - base <= 256 + 8
    store.clone("s", "c")
    assert store.read("c", 0, MiB) == data
    with pytest.raises(FailedPrecondition, match=r"snapshot 's' has clones \(c\)"):
        store.delete_snapshot("s")
    assert store.read("c", 0, MiB) == data  # the refused delete changed nothing
    store.delete("c")
    store.delete_snapshot("s")
    assert used(store) - base <= 8  # only log chunks are left
    assert store.list_snapshots() == []


def test_deleting_a_snapshot_merges_it_into_its_volume(store):
    store.create("v", MiB, 4096, XTS)
    first = mixed_data(MiB, 3)
    store.write("v", 0, first)
    store.create_snapshot("v", "s1")
    store.write("v", 0, b"x" * 32768)
    store.create_snapshot("v", "s2")
    store.write("v", 32768, b"y" * 4096)
    store.trim("v", 36864, 4096)
    expected_v = b"x" * 32768 + b"y" * 4096 + bytes(4096) + first[40960:]
    expected_s2 = b"x" * 32768 + first[32768:]
    base = used(store)
    store.delete_snapshot("s1")  # s2 depends on it: s1's blocks s2 does not hide move there
    assert used(store) <= base - 7  # the 8 blocks s2 hides are freed (the log may grow by 1)
    assert store.read("v", 0, MiB) == expected_v
    store.clone("s2", "c")
    assert store.read("c", 0, MiB) == expected_s2
    store.delete("c")
    store.delete_snapshot("s2")  # now into the volume itself
    assert store.read("v", 0, MiB) == expected_v
    assert store.list_snapshots() == []


def test_a_clone_can_be_snapshotted_and_cloned_again(store):
    store.create("v", MiB, 4096, XTS)
    store.write("v", 0, b"a" * MiB)
    store.create_snapshot("v", "s")
    store.clone("s", "c")
    store.write("c", 0, b"b" * 4096)
    store.create_snapshot("c", "sc")
    store.write("c", 0, b"c" * 4096)
    store.clone("sc", "cc")
    assert store.read("cc", 0, 8192) == b"b" * 4096 + b"a" * 4096
    store.delete("c")
    with pytest.raises(FailedPrecondition, match="has clones"):
        store.delete_snapshot("s")  # sc was taken of its clone
    store.delete("cc")
    store.delete_snapshot("sc")
    store.delete_snapshot("s")
    assert store.read("v", 0, MiB) == b"a" * MiB


def test_shrinking_a_clone_over_its_snapshot_data_needs_force(store):
    store.create("v", 2 * MiB, 4096, DataServices())
    store.write("v", MiB, b"z" * 4096)
    store.create_snapshot("v", "s")
    store.clone("s", "c")
    with pytest.raises(FailedPrecondition, match="holds data past"):
        store.resize("c", MiB)
    store.resize("c", MiB, force=True)
    store.resize("c", 2 * MiB)
    assert store.read("c", MiB, 4096) == bytes(4096)  # the snapshot's block stays hidden
    assert store.read("v", MiB, 4096) == b"z" * 4096


def test_bad_snapshot_and_clone_calls_change_nothing(store):
    store.create("v", MiB, 4096, DataServices())
    store.create_snapshot("v", "s")
    with pytest.raises(AlreadyExists, match="snapshot 's' already exists"):
        store.create_snapshot("v", "s")
    with pytest.raises(NotFound, match="volume 'w' does not exist"):
        store.create_snapshot("w", "t")
    with pytest.raises(NotFound, match="snapshot 'nope' does not exist"):
        store.clone("nope", "c")
    with pytest.raises(AlreadyExists, match="volume 'v' already exists"):
        store.clone("s", "v")
    with pytest.raises(InvalidArgument, match="smaller than snapshot 's'"):
        store.clone("s", "c", MiB // 2)
    with pytest.raises(InvalidArgument, match="not a lowercase DNS label"):
        store.create_snapshot("v", "Bad")
    with pytest.raises(NotFound):
        store.delete_snapshot("nope")
    assert [s.snapshot_id for s in store.list_snapshots()] == ["s"]
    assert [v.volume_id for v in store.list()] == ["v"]


def test_the_chain_of_snapshots_is_bounded(store):
    store.create("v", MiB, 4096, DataServices())
    for i in range(MAX_CHAIN_DEPTH - 1):
        store.write("v", 0, bytes([i]) * 4096)
        store.create_snapshot("v", f"s{i}")
    with pytest.raises(FailedPrecondition, match="delete old ones first"):
        store.create_snapshot("v", "one-more")
    store.delete_snapshot("s10")
    store.create_snapshot("v", "one-more")
    store.clone("s20", "c")
    assert store.read("c", 0, 4096) == bytes([20]) * 4096


def test_snapshots_clones_and_keys_survive_a_restart(tmp_path):
    data = os.urandom(MiB)
    with FileVolumeStore(tmp_path) as store:
        store.create("v", MiB, 4096, XTS, tenant="t1")
        store.write("v", 0, data, fua=True)
        store.create_snapshot("v", "s")
        store.clone("s", "c")
        store.write("c", 0, b"c" * 4096)
        store.delete("v")  # the snapshot keeps the key it needs
    with FileVolumeStore(tmp_path) as store:
        assert store.get_snapshot("s").tenant == "t1"
        assert store.get("c").tenant == "t1"
        assert store.read("c", 0, MiB) == b"c" * 4096 + data[4096:]
        store.clone("s", "c2")
        assert store.read("c2", 0, MiB) == data


def test_a_snapshot_takes_the_map_not_the_data(store, monkeypatch):
    """Creation moves the volume's block map to the snapshot: no block is touched or copied."""
    monkeypatch.setattr(store, "_free_bytes", lambda: 1 << 40)  # thin: nothing is reserved
    store.create("v", 64 << 30, 4096, DataServices())
    store.write("v", 0, os.urandom(MiB))
    store.write("v", 60 << 30, os.urandom(MiB))
    before = store._state.volumes["v"].map
    written = store._pool.size()
    store.create_snapshot("v", "s")
    assert store._state.snapshots["s"].map is before
    assert len(store._state.volumes["v"].map) == 0
    assert store._pool.size() - written <= 8192  # a log block or two

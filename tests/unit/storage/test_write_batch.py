"""`write_batch`: several writes in one store call, with the effect of one `write` each in order."""

import os
import random

import pytest

from dpu_agent.dataplane.volumes import TenantVolumes
from dpu_agent.errors import FailedPrecondition, InvalidArgument, NotFound
from dpu_agent.storage import Compression, DataServices, QosLimits
from dpu_agent.storage.exports import GuardedVolumeStore, VolumeExports

from .conftest import ALL_SERVICES, MiB, make_store, services_id


@pytest.mark.parametrize("services", ALL_SERVICES, ids=services_id)
def test_a_batch_reads_back_as_the_writes_one_by_one(store, services):
    """Runs of one volume and of two interleaved, one-block and multi-block writes, and
    the same block written twice in a batch (the later write wins)."""
    size = 256 << 10
    for v in ("batched", "single", "other"):
        store.create(v, size, 4096, services)
    rng = random.Random(7)  # noqa: S311 - test data, not secrets
    for round_ in range(6):
        writes: list[tuple[str, int, bytes | memoryview]] = []
        for i in range(rng.randrange(1, 24)):
            blocks = rng.choice([1, 1, 1, 2, 5])
            offset = rng.randrange(size // 4096 - blocks + 1) * 4096
            if i and rng.random() < 0.2:
                offset = writes[-1][1]  # overwrite the one before, within the batch
                blocks = len(writes[-1][2]) // 4096
            data = os.urandom(blocks * 4096) if i % 2 else bytes([round_ + 1]) * blocks * 4096
            volume = "other" if round_ % 2 and rng.random() < 0.3 else "batched"
            writes.append((volume, offset, memoryview(data) if i % 3 else data))
        assert store.write_batch(writes) == [None] * len(writes)
        for volume, offset, written in writes:
            if volume == "batched":
                store.write("single", offset, written)
    assert store.read("batched", 0, size) == store.read("single", 0, size)
    assert store.stats("batched").write_ops == store.stats("single").write_ops
    assert store.stats("batched").write_bytes == store.stats("single").write_bytes
    store.flush("batched")


def test_each_write_gets_its_own_error_and_the_others_land(store):
    store.create("v", MiB, 4096, DataServices(crc32c=True))
    store.write("v", 0, b"o" * 16384)
    writes = [
        ("v", 0, b"a" * 4096),
        ("v", 100, b"b" * 4096),  # not block-aligned
        ("v", MiB, b"c" * 4096),  # past the end
        ("missing", 0, b"d" * 4096),
        ("v", 4096, b"e" * 100),  # not whole blocks
        ("v", 8192, b"f" * 4096),
    ]
    results = store.write_batch(writes)
    assert results[0] is None
    assert results[5] is None
    assert [type(r) for r in results[1:5]] == [
        InvalidArgument,
        InvalidArgument,
        NotFound,
        InvalidArgument,
    ]
    assert "does not exist" in str(results[3])
    assert store.read("v", 0, 16384) == b"a" * 4096 + b"o" * 4096 + b"f" * 4096 + b"o" * 4096
    assert store.write_batch([]) == []


def test_a_batch_after_close_fails_every_write(backend, tmp_path):
    store = make_store(backend, tmp_path)
    store.create("v", MiB, 4096, DataServices())
    store.close()
    results = store.write_batch([("v", 0, b"a" * 4096), ("v", 4096, b"b" * 4096)])
    assert all(isinstance(r, FailedPrecondition) for r in results), results


def test_exported_and_foreign_volumes_are_refused_within_a_batch(store):
    exports = VolumeExports()
    guarded = GuardedVolumeStore(store, exports)
    guarded.create("mine", MiB, 4096, DataServices(), tenant="t1")
    guarded.create("exported", MiB, 4096, DataServices(), tenant="t1")
    guarded.create("theirs", MiB, 4096, DataServices(), tenant="t2")
    exports.claim("exported", "functions/disk")
    tenant = TenantVolumes(guarded, "t1")
    writes = [
        ("mine", 0, memoryview(b"a" * 4096)),
        ("exported", 0, memoryview(b"b" * 4096)),
        ("theirs", 0, memoryview(b"c" * 4096)),
        ("mine", 4096, memoryview(b"d" * 4096)),
    ]
    results = tenant.write_batch(writes)
    assert results[0] is None
    assert results[3] is None
    assert isinstance(results[1], FailedPrecondition)
    assert "exported to the host by functions/disk" in str(results[1])
    assert isinstance(results[2], NotFound)
    assert store.read("mine", 0, 8192) == b"a" * 4096 + b"d" * 4096
    assert store.read("exported", 0, 4096) == bytes(4096)
    assert store.read("theirs", 0, 4096) == bytes(4096)


def test_a_batch_to_one_refused_volume_is_refused_whole(store):
    """The one-volume case (a QD1 write, say) is checked once, and as strictly."""
    exports = VolumeExports()
    guarded = GuardedVolumeStore(store, exports)
    guarded.create("exported", MiB, 4096, DataServices(), tenant="t1")
    guarded.create("theirs", MiB, 4096, DataServices(), tenant="t2")
    exports.claim("exported", "functions/disk")
    tenant = TenantVolumes(guarded, "t1")
    for volume, refused in (("exported", FailedPrecondition), ("theirs", NotFound)):
        writes = [(volume, i * 4096, memoryview(b"x" * 4096)) for i in range(3)]
        results = tenant.write_batch(writes)
        assert [type(r) for r in results] == [refused] * 3
        assert store.read(volume, 0, 3 * 4096) == bytes(3 * 4096)
    assert tenant.write_batch([]) == []


def test_a_batch_survives_a_reopen(tmp_path):
    """What a batch wrote and flushed is there after the file store opens again (its
    records were logged like single writes')."""
    with make_store("file", tmp_path) as store:
        store.create("v", MiB, 4096, DataServices(crc32c=True))
        store.write_batch([("v", i * 8192, bytes([i]) * 4096) for i in range(1, 40)])
        store.flush("v")
    with make_store("file", tmp_path) as store:
        for i in range(1, 40):
            assert store.read("v", i * 8192, 4096) == bytes([i]) * 4096


@pytest.mark.parametrize("compression", [Compression.NONE, Compression.LZ4])
def test_a_write_of_more_blocks_than_one_vectored_write_takes(store, compression):
    """2,048 blocks of 512 bytes, compressible ones (short, padded) between random ones:
    more buffers than one vectored write takes, so it goes in several."""
    store.create("v", 2 * MiB, 512, DataServices(compression=compression))
    data = b"".join(os.urandom(512) if i % 3 else bytes([i % 251]) * 512 for i in range(2048))
    store.write("v", 0, data)
    store.write_batch([("v", MiB, data[:4096]), ("v", 0, data[4096:8192])])
    assert store.read("v", 0, MiB) == data[4096:8192] + data[4096:MiB]
    assert store.read("v", MiB, MiB) == data[:4096] + bytes(MiB - 4096)


def test_a_foreign_volume_spends_none_of_its_qos_budget(store):
    """A handle kept after its volume was deleted and made again by another tenant under
    the same id: its I/O fails NOT_FOUND, and it must not take that volume's tokens
    (the throttle runs before the I/O is tried)."""
    store.create("data", MiB, 4096, DataServices(), tenant="t2", qos=QosLimits(write_iops=20))
    tenant = TenantVolumes(store, "t1")
    for _ in range(50):
        with pytest.raises(NotFound):
            tenant.throttle("data", "write", 4096)
    assert TenantVolumes(store, "t2").throttle("data", "write", 4096).wait == 0.0

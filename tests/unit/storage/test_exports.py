"""An exported volume: everyone but its block function is kept off, but it may be snapshotted."""

import pytest

from dpu_agent.errors import FailedPrecondition
from dpu_agent.storage import DataServices, QosLimits
from dpu_agent.storage.exports import GuardedVolumeStore, VolumeExports

from .conftest import MiB


def test_a_snapshot_of_an_exported_volume_is_crash_consistent(store):
    exports = VolumeExports()
    guarded = GuardedVolumeStore(store, exports)
    guarded.create("v", MiB, 4096, DataServices(crc32c=True))
    exports.claim("v", "functions/disk")
    store.write("v", 0, b"a" * 8192, fua=True)  # the block function writes (unguarded)
    store.write("v", 8192, b"b" * 4096)  # acknowledged, not yet flushed
    snap = guarded.create_snapshot("v", "s")
    store.write("v", 0, b"c" * 4096)  # after the snapshot: not in it
    assert snap.source_volume == "v"
    with pytest.raises(FailedPrecondition, match="exported to the host by functions/disk"):
        guarded.read("v", 0, 4096)
    guarded.clone("s", "c")  # the image is usable at once, without the function
    assert guarded.read("c", 0, 12288) == b"a" * 8192 + b"b" * 4096
    guarded.set_qos("v", QosLimits(write_iops=100))  # limits may change while exported
    assert guarded.get("v").qos.write_iops == 100
    assert [s.snapshot_id for s in guarded.list_snapshots()] == ["s"]
    guarded.delete("c")
    guarded.delete_snapshot("s")
    exports.release("v", "functions/disk")
    assert guarded.read("v", 0, 4096) == b"c" * 4096

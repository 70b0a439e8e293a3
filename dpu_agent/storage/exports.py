"""Volumes a block function exports to the host, and a store that keeps others off them.

While a block function exposes a volume as a block device, the host's filesystem owns
its blocks: any other writer (or reader, whose view would be stale against the host's
page cache) would corrupt or misread it. `VolumeExports` records which function holds
which volume; `GuardedVolumeStore` is the store every other user (the storage service,
data-plane sessions) goes through, and it refuses I/O, resize and delete of an
exported volume with FailedPrecondition naming the function. The export itself uses
the unguarded store.

A snapshot of an exported volume is allowed, and crash-consistent: it holds every
write the block device acknowledged before the snapshot, and none after, exactly
what the disk would hold after a power cut at that instant (what the host still had
in its page cache is not in it, as after a crash; freeze the filesystem first, e.g.
`fsfreeze`, for a clean one). QoS limits may change while exported too.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from dpu_agent.auth import DEFAULT_TENANT
from dpu_agent.errors import FailedPrecondition
from dpu_agent.storage.backend import VolumeStore, screened_batch

if TYPE_CHECKING:
    import builtins
    from collections.abc import Sequence

    from dpu_agent.errors import AgentError
    from dpu_agent.storage.backend import BatchedWrite
    from dpu_agent.storage.qos import Reservation
    from dpu_agent.storage.types import (
        DataServices,
        QosLimits,
        SnapshotInfo,
        VolumeInfo,
        VolumeStats,
    )


class VolumeExports:
    """volume id -> the function that exports it. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: dict[str, str] = {}

    def claim(self, volume_id: str, holder: str) -> None:
        """Give `holder` the volume; FailedPrecondition if another holder has it."""
        with self._lock:
            current = self._holders.get(volume_id)
            if current is not None and current != holder:
                raise FailedPrecondition(f"volume {volume_id!r} is already exported by {current}")
            self._holders[volume_id] = holder

    def release(self, volume_id: str, holder: str) -> None:
        """Take the volume back from `holder` (no error if it does not hold it)."""
        with self._lock:
            if self._holders.get(volume_id) == holder:
                del self._holders[volume_id]

    def holder(self, volume_id: str) -> str | None:
        """Who exports the volume, or None."""
        with self._lock:
            return self._holders.get(volume_id)

    def check_free(self, volume_id: str, action: str) -> None:
        """FailedPrecondition if the volume is exported."""
        holder = self.holder(volume_id)
        if holder is not None:
            raise FailedPrecondition(
                f"cannot {action} volume {volume_id!r}: it is exported to the host by {holder}"
                " (delete the function first)"
            )


class GuardedVolumeStore(VolumeStore):
    """A volume store that refuses to touch exported volumes; everything else passes through."""

    def __init__(self, inner: VolumeStore, exports: VolumeExports) -> None:
        self.inner = inner
        self.exports = exports

    @property
    def max_volume_bytes(self) -> int:
        """See `VolumeStore.max_volume_bytes`."""
        return self.inner.max_volume_bytes

    def create(  # noqa: PLR0913 - a volume's settings and its owner
        self,
        volume_id: str,
        size_bytes: int,
        block_size: int,
        services: DataServices,
        key: bytes | None = None,
        *,
        tenant: str = DEFAULT_TENANT,
        qos: QosLimits | None = None,
    ) -> VolumeInfo:
        """See `VolumeStore.create`."""
        return self.inner.create(
            volume_id, size_bytes, block_size, services, key, tenant=tenant, qos=qos
        )

    def get(self, volume_id: str) -> VolumeInfo:
        """See `VolumeStore.get`."""
        return self.inner.get(volume_id)

    def list(self, tenant: str | None = None) -> builtins.list[VolumeInfo]:
        """See `VolumeStore.list`."""
        return self.inner.list(tenant)

    def resize(self, volume_id: str, size_bytes: int, *, force: bool = False) -> VolumeInfo:
        """See `VolumeStore.resize`; refused while exported."""
        self.exports.check_free(volume_id, "resize")
        return self.inner.resize(volume_id, size_bytes, force=force)

    def delete(self, volume_id: str) -> None:
        """See `VolumeStore.delete`; refused while exported."""
        self.exports.check_free(volume_id, "delete")
        self.inner.delete(volume_id)

    def read(self, volume_id: str, offset: int, length: int) -> bytes:
        """See `VolumeStore.read`; refused while exported."""
        self.exports.check_free(volume_id, "read")
        return self.inner.read(volume_id, offset, length)

    def write(
        self, volume_id: str, offset: int, data: bytes | memoryview, *, fua: bool = False
    ) -> None:
        """See `VolumeStore.write`; refused while exported."""
        self.exports.check_free(volume_id, "write")
        self.inner.write(volume_id, offset, data, fua=fua)

    def write_batch(self, writes: Sequence[BatchedWrite]) -> builtins.list[AgentError | None]:
        """See `VolumeStore.write_batch`; writes to exported volumes refused."""
        check = self.exports.check_free
        return screened_batch(writes, lambda vid: check(vid, "write"), self.inner.write_batch)

    def flush(self, volume_id: str) -> None:
        """See `VolumeStore.flush`; refused while exported."""
        self.exports.check_free(volume_id, "flush")
        self.inner.flush(volume_id)

    def trim(self, volume_id: str, offset: int, length: int) -> None:
        """See `VolumeStore.trim`; refused while exported."""
        self.exports.check_free(volume_id, "trim")
        self.inner.trim(volume_id, offset, length)

    def stats(self, volume_id: str) -> VolumeStats:
        """See `VolumeStore.stats`."""
        return self.inner.stats(volume_id)

    def set_qos(self, volume_id: str, qos: QosLimits) -> VolumeInfo:
        """See `VolumeStore.set_qos` (allowed while exported)."""
        return self.inner.set_qos(volume_id, qos)

    def throttle(self, volume_id: str, op: str, nbytes: int) -> Reservation:
        """See `VolumeStore.throttle`."""
        return self.inner.throttle(volume_id, op, nbytes)

    def create_snapshot(self, volume_id: str, snapshot_id: str) -> SnapshotInfo:
        """See `VolumeStore.create_snapshot`; crash-consistent while exported (module doc)."""
        return self.inner.create_snapshot(volume_id, snapshot_id)

    def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        """See `VolumeStore.get_snapshot`."""
        return self.inner.get_snapshot(snapshot_id)

    def list_snapshots(self, tenant: str | None = None) -> builtins.list[SnapshotInfo]:
        """See `VolumeStore.list_snapshots`."""
        return self.inner.list_snapshots(tenant)

    def delete_snapshot(self, snapshot_id: str) -> None:
        """See `VolumeStore.delete_snapshot`."""
        self.inner.delete_snapshot(snapshot_id)

    def clone(
        self,
        snapshot_id: str,
        volume_id: str,
        size_bytes: int = 0,
        *,
        tenant: str | None = None,
        qos: QosLimits | None = None,
    ) -> VolumeInfo:
        """See `VolumeStore.clone`."""
        return self.inner.clone(snapshot_id, volume_id, size_bytes, tenant=tenant, qos=qos)

    def close(self) -> None:
        """Close the store underneath."""
        self.inner.close()

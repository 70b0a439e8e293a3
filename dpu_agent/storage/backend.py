"""The volume store interface the storage service talks to.

A backend keeps block volumes and applies their data services. The interface names
volumes, byte offsets and lengths, nothing about files: an SPDK JSON-RPC backend
(bdev_* calls, with SPDK's own crypto/compress bdevs) can implement it later without
the service changing.

The API is synchronous and thread-safe; the gRPC service calls it in a thread
(`dpu_agent.offload.in_thread`). Every method raises domain errors only (`dpu_agent.errors`,
`dpu_agent.storage.errors.DataCorruption`):

- InvalidArgument: a bad id, size, block size, key, QoS limit, or an I/O range that
  is unaligned, empty, negative or past the end of the volume; nothing is written.
- NotFound: no volume (or snapshot) with that id. AlreadyExists: an id in use.
- FailedPrecondition: shrinking over data without `force`, deleting a snapshot that
  has clones, a snapshot chain at its limit, or the store is closed.
- ResourceExhausted: the volume does not fit (size limit, free space), disk full.
- DataCorruption: a block failed its CRC32C check or could not be decoded.
- Unavailable: the backing storage failed (the agent must restart to recover).

Snapshots are read-only point-in-time images of a volume, made in a time that does
not depend on the volume's size; a clone is a new writable volume that starts as a
snapshot's image and shares its blocks until it overwrites them.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Self, TypeAlias

from dpu_agent.auth import DEFAULT_TENANT
from dpu_agent.errors import AgentError

if TYPE_CHECKING:
    import builtins
    from collections.abc import Callable, Sequence
    from types import TracebackType

    from dpu_agent.storage.qos import Reservation
    from dpu_agent.storage.types import (
        DataServices,
        QosLimits,
        SnapshotInfo,
        VolumeInfo,
        VolumeStats,
    )


BatchedWrite: TypeAlias = "tuple[str, int, bytes | memoryview]"  # (volume id, offset, data)


def screened_batch(
    writes: Sequence[BatchedWrite],
    check: Callable[[str], object],
    inner: Callable[[builtins.list[BatchedWrite]], builtins.list[AgentError | None]],
) -> builtins.list[AgentError | None]:
    """`write_batch` through a per-volume `check`.

    Writes to a volume `check` refuses get its error; the others go to `inner` together,
    in order.
    """
    verdicts: dict[str, AgentError | None] = {}
    results: builtins.list[AgentError | None] = [None] * len(writes)
    passing: builtins.list[BatchedWrite] = []
    where: builtins.list[int] = []
    for i, write in enumerate(writes):
        volume_id = write[0]
        if volume_id not in verdicts:
            try:
                check(volume_id)
            except AgentError as exc:
                verdicts[volume_id] = exc
            else:
                verdicts[volume_id] = None
        error = verdicts[volume_id]
        if error is None:
            passing.append(write)
            where.append(i)
        else:
            results[i] = error
    if passing:
        for i, result in zip(where, inner(passing), strict=True):
            results[i] = result
    return results


class VolumeStore(abc.ABC):
    """Block volumes with per-block data services. A context manager; `close()` twice is fine."""

    @property
    @abc.abstractmethod
    def max_volume_bytes(self) -> int:
        """The largest volume this store creates (`create`, `clone` and `resize` check it)."""

    @abc.abstractmethod
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
        """Create a volume that reads as zeros, owned by `tenant`.

        `key` is the 64-byte AES-XTS-256 key of an encrypted volume; None makes the
        store generate one. The store keeps the key sealed and never returns it. The
        owner is kept with the volume (`VolumeInfo.tenant`); the store does not check
        it, the services do (`dpu_agent.auth`). `qos` sets its I/O limits (none by
        default).
        """

    @abc.abstractmethod
    def get(self, volume_id: str) -> VolumeInfo:
        """Describe a volume."""

    @abc.abstractmethod
    def list(self, tenant: str | None = None) -> builtins.list[VolumeInfo]:
        """Every volume (of `tenant`, when given), sorted by id."""

    @abc.abstractmethod
    def resize(self, volume_id: str, size_bytes: int, *, force: bool = False) -> VolumeInfo:
        """Grow or shrink a volume; shrinking over written blocks needs `force` and drops them."""

    @abc.abstractmethod
    def delete(self, volume_id: str) -> None:
        """Delete a volume, its data and its key."""

    @abc.abstractmethod
    def read(self, volume_id: str, offset: int, length: int) -> bytes:
        """Read whole blocks; blocks never written (or trimmed) read as zeros."""

    @abc.abstractmethod
    def write(
        self, volume_id: str, offset: int, data: bytes | memoryview, *, fua: bool = False
    ) -> None:
        """Write whole blocks; with `fua` the data is durable when the call returns."""

    def write_batch(self, writes: Sequence[BatchedWrite]) -> builtins.list[AgentError | None]:
        """Several writes (not FUA), with the same effect as `write` for each in order.

        Returns each write's error, or None: one write's error does not stop the others.
        A store may share work between writes to the same volume (one allocation, one
        log reservation); this default makes one `write` call per write.
        """
        results: builtins.list[AgentError | None] = []
        for volume_id, offset, data in writes:
            try:
                self.write(volume_id, offset, data)
            except AgentError as exc:
                results.append(exc)
            else:
                results.append(None)
        return results

    @abc.abstractmethod
    def flush(self, volume_id: str) -> None:
        """Make every write to the volume acknowledged so far durable."""

    @abc.abstractmethod
    def trim(self, volume_id: str, offset: int, length: int) -> None:
        """Forget whole blocks: they read as zeros again and give their space back."""

    @abc.abstractmethod
    def stats(self, volume_id: str) -> VolumeStats:
        """I/O counters of the volume since the store opened it."""

    @abc.abstractmethod
    def set_qos(self, volume_id: str, qos: QosLimits) -> VolumeInfo:
        """Change the volume's QoS limits (durably); its token buckets start full."""

    @abc.abstractmethod
    def throttle(self, volume_id: str, op: str, nbytes: int) -> Reservation:
        """Reserve one `op` ("read" or "write") of `nbytes` against the volume's QoS limits.

        Returns the reservation: `wait`, the seconds the caller must wait before doing
        the I/O (0.0 when it is within its limits, or the volume is unknown: the I/O
        itself reports that). Never blocks and never refuses: the caller waits
        (asynchronously), then does the I/O; if it will not do the I/O after all (its
        job ended while it waited), it calls `give_back()` on the reservation. Cheap
        enough for the event loop's thread.
        """

    @abc.abstractmethod
    def create_snapshot(self, volume_id: str, snapshot_id: str) -> SnapshotInfo:
        """A read-only image of the volume as it is now (every acknowledged write), durably.

        The snapshot belongs to the volume's tenant and outlives the volume.
        """

    @abc.abstractmethod
    def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        """Describe a snapshot."""

    @abc.abstractmethod
    def list_snapshots(self, tenant: str | None = None) -> builtins.list[SnapshotInfo]:
        """Every snapshot (of `tenant`, when given), sorted by id."""

    @abc.abstractmethod
    def delete_snapshot(self, snapshot_id: str) -> None:
        """Delete a snapshot, freeing the blocks nothing else uses.

        FailedPrecondition if volumes were cloned from it (delete them first).
        """

    @abc.abstractmethod
    def clone(
        self,
        snapshot_id: str,
        volume_id: str,
        size_bytes: int = 0,
        *,
        tenant: str | None = None,
        qos: QosLimits | None = None,
    ) -> VolumeInfo:
        """A new writable volume that reads as the snapshot, sharing its blocks.

        It has the snapshot's block size, data services and key; `size_bytes` 0 means
        the snapshot's size, and a larger one reads zeros past it. `tenant` None: the
        snapshot's.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Flush every volume and release the store's resources. Idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

"""StorageService: block volumes, snapshots and clones on the DPU (a thin gRPC layer).

Every volume belongs to the tenant that created it (kept in the store's metadata); a
snapshot belongs to its volume's tenant, a clone to its snapshot's. A tenant sees,
changes and deletes only its own; another tenant's volume or snapshot answers
NOT_FOUND exactly as a missing one does. Admins see all. Ids are one namespace per
agent (common.proto): creating an id another tenant holds answers ALREADY_EXISTS.
A retried create answers as the first did (`dpu_agent.replies`, in the interceptor).

Quotas (`[quota] max_volumes`, `max_volume_bytes`) bound what a tenant can come to
hold, so that no write ever fails on a quota: its volumes count their provisioned
size (a clone too: it may be overwritten in full), its snapshots the bytes they hold
(what was written before them, which they keep while the volume moves on). They are
checked by create, clone, growth and snapshot. `max_volumes` bounds the number of
volumes, clones included (1024 by default): a volume holds no bytes until written,
and `max_volume_bytes` is off by default, so without it a tenant could make volumes
without end, each one kept in the agent's memory and walked by every tenant's create
and list. `max_snapshots` bounds the number of
snapshots (1024 by default): a snapshot of an empty volume holds no bytes, and
snapshots outlive their volumes, so without it a tenant could pile them up for free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from dpu_agent import auth, paging
from dpu_agent.errors import InvalidArgument
from dpu_agent.fair_lock import FairLock
from dpu_agent.offload import in_thread
from dpu_agent.quota import Quotas
from dpu_agent.services.convert import resource_id, timestamp
from dpu_agent.storage import Compression, DataServices, Encryption, QosLimits
from dpu_agent.storage.validate import check_block_size, check_size
from dpu_wire import names
from dpu_wire.v1 import common_pb2, storage_pb2, storage_pb2_grpc

if TYPE_CHECKING:
    import grpc

    from dpu_agent.storage import SnapshotInfo, VolumeInfo, VolumeStats, VolumeStore

_COMPRESSION: Final = {
    storage_pb2.COMPRESSION_UNSPECIFIED: Compression.NONE,
    storage_pb2.COMPRESSION_NONE: Compression.NONE,
    storage_pb2.COMPRESSION_LZ4: Compression.LZ4,
    storage_pb2.COMPRESSION_ZSTD: Compression.ZSTD,
}
_ENCRYPTION: Final = {
    storage_pb2.ENCRYPTION_UNSPECIFIED: Encryption.NONE,
    storage_pb2.ENCRYPTION_NONE: Encryption.NONE,
    storage_pb2.ENCRYPTION_AES_XTS_256: Encryption.AES_XTS_256,
}
_COMPRESSION_OUT: Final = {
    Compression.NONE: storage_pb2.COMPRESSION_NONE,
    Compression.LZ4: storage_pb2.COMPRESSION_LZ4,
    Compression.ZSTD: storage_pb2.COMPRESSION_ZSTD,
}
_ENCRYPTION_OUT: Final = {
    Encryption.NONE: storage_pb2.ENCRYPTION_NONE,
    Encryption.AES_XTS_256: storage_pb2.ENCRYPTION_AES_XTS_256,
}
QOS_FIELDS: Final = (
    "read_iops",
    "write_iops",
    "read_bytes_per_second",
    "write_bytes_per_second",
)
# update_mask path -> the QoS fields it changes
_UPDATABLE: Final = {"qos": QOS_FIELDS, **{f"qos.{f}": (f,) for f in QOS_FIELDS}}


def volume_id(name: str) -> str:
    """The id in "volumes/{id}"."""
    (ident,) = names.parse_name(name, "volumes")
    return ident


def snapshot_id(name: str) -> str:
    """The id in "snapshots/{id}"."""
    (ident,) = names.parse_name(name, "snapshots")
    return ident


def _services(services: DataServices) -> storage_pb2.DataServices:
    return storage_pb2.DataServices(
        crc32c=services.crc32c,
        compression=_COMPRESSION_OUT[services.compression],
        encryption=_ENCRYPTION_OUT[services.encryption],
    )


def qos_from(qos: storage_pb2.QosLimits) -> QosLimits:
    """QosLimits from the API form (the store checks the ranges)."""
    return QosLimits(**{f: getattr(qos, f) for f in QOS_FIELDS})


def qos_to(qos: QosLimits) -> storage_pb2.QosLimits:
    """The API form of QosLimits."""
    return storage_pb2.QosLimits(**{f: getattr(qos, f) for f in QOS_FIELDS})


def to_proto(info: VolumeInfo, stats: VolumeStats | None = None) -> storage_pb2.Volume:
    """The API form of a volume (never its key)."""
    volume = storage_pb2.Volume(
        name=f"volumes/{info.volume_id}",
        size_bytes=info.size_bytes,
        block_size=info.block_size,
        data_services=_services(info.services),
        tenant=info.tenant,
        times=common_pb2.ResourceTimes(
            create_time=timestamp(info.create_ns), update_time=timestamp(info.update_ns)
        ),
        qos=qos_to(info.qos),
        source_snapshot=f"snapshots/{info.source_snapshot}" if info.source_snapshot else "",
    )
    if stats is not None:
        volume.stats.CopyFrom(
            storage_pb2.VolumeStats(
                read_ops=stats.read_ops,
                write_ops=stats.write_ops,
                read_bytes=stats.read_bytes,
                write_bytes=stats.write_bytes,
                errors=stats.errors,
                latency_bounds_us=stats.latency_bounds_us,
                latency_counts=stats.latency_counts,
                throttled_ops=stats.throttled_ops,
                throttle_delay_us=stats.throttle_delay_us,
                allocated_bytes=stats.allocated_bytes,
            )
        )
    return volume


def snapshot_to(info: SnapshotInfo) -> storage_pb2.Snapshot:
    """The API form of a snapshot (never its key)."""
    return storage_pb2.Snapshot(
        name=f"snapshots/{info.snapshot_id}",
        source_volume=f"volumes/{info.source_volume}",
        size_bytes=info.size_bytes,
        block_size=info.block_size,
        data_services=_services(info.services),
        tenant=info.tenant,
        times=common_pb2.ResourceTimes(
            create_time=timestamp(info.create_ns), update_time=timestamp(info.create_ns)
        ),
        allocated_bytes=info.allocated_bytes,
        clones=[f"volumes/{c}" for c in info.clones],
    )


def _listed_tenant() -> str | None:
    """Whose objects the caller lists: its tenant's, or (an admin) everyone's (None).

    The store passes over other tenants' objects itself, under its lock, rather than
    making infos of every object for the service to filter.
    """
    principal = auth.current_principal()
    return None if principal.admin else principal.tenant


class StorageService(storage_pb2_grpc.StorageServiceServicer):
    """Volumes, snapshots and clones; the store does the work in a thread."""

    def __init__(self, store: VolumeStore, quotas: Quotas | None = None) -> None:
        self._store = store
        self._quotas = quotas or Quotas()
        # changes that need ownership and quota checks to hold while they run; tenants
        # take it in turns (`dpu_agent.fair_lock`)
        self._changes = FairLock()

    # ------------------------------------------------------------ helpers

    async def _owned(self, ident: str) -> VolumeInfo:
        """The volume, if the caller may see it; NotFound as for a missing one otherwise."""
        info = await in_thread(self._store.get, ident)
        auth.check_owner(info.tenant, f"volume {ident!r}")  # the store's own not-found text
        return info

    async def _owned_snapshot(self, ident: str) -> SnapshotInfo:
        info = await in_thread(self._store.get_snapshot, ident)
        auth.check_owner(info.tenant, f"snapshot {ident!r}")
        return info

    async def _volume(self, ident: str) -> storage_pb2.Volume:
        info = await self._owned(ident)
        stats = await in_thread(self._store.stats, ident)
        return to_proto(info, stats)

    async def _check_quota(
        self, tenant: str, volumes: int, more_bytes: int, snapshots: int = 0
    ) -> None:
        """The tenant's holdings and `volumes`, `more_bytes`, `snapshots` more would fit."""
        owned = await in_thread(self._store.list, tenant)
        snaps = await in_thread(self._store.list_snapshots, tenant)
        if snapshots:
            self._quotas.check_snapshots(tenant, len(snaps) + snapshots)
        held = sum(v.size_bytes for v in owned) + sum(s.allocated_bytes for s in snaps)
        self._quotas.check_volumes(tenant, len(owned) + volumes, held + more_bytes)

    def _check_size(self, size_bytes: int, block_size: int) -> None:
        """INVALID_ARGUMENT for a size the store refuses, before any quota is weighed.

        The store checks again; checking here too makes the answer to a bad size the
        same whether a quota is set or not.
        """
        check_size(size_bytes, block_size, self._store.max_volume_bytes)

    # ------------------------------------------------------------ volumes

    async def CreateVolume(
        self, request: storage_pb2.CreateVolumeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> storage_pb2.Volume:
        """Create a volume with its data services (the key sealed, never returned), or a clone."""
        tenant = auth.tenant()
        spec = request.volume
        if spec.source_snapshot:
            return await self._clone(request, tenant)
        if spec.size_bytes == 0:
            raise InvalidArgument("volume.size_bytes is required")
        services = DataServices(
            crc32c=spec.data_services.crc32c,
            compression=_COMPRESSION[spec.data_services.compression],
            encryption=_ENCRYPTION[spec.data_services.encryption],
        )
        self._check_size(spec.size_bytes, check_block_size(spec.block_size or 4096))
        async with self._changes.hold():
            await self._check_quota(tenant, 1, spec.size_bytes)
            info = await in_thread(
                lambda: self._store.create(
                    request.volume_id,
                    spec.size_bytes,
                    spec.block_size or 4096,
                    services,
                    request.encryption_key or None,
                    tenant=tenant,
                    qos=qos_from(spec.qos),
                )
            )
        return to_proto(info)

    async def _clone(
        self, request: storage_pb2.CreateVolumeRequest, tenant: str
    ) -> storage_pb2.Volume:
        spec = request.volume
        source = resource_id(spec.source_snapshot, "snapshots", "volume.source_snapshot")
        if spec.HasField("data_services") or spec.block_size or request.encryption_key:
            raise InvalidArgument(
                "a clone (volume.source_snapshot) takes its block size, data services and key "
                "from its snapshot: leave volume.block_size, volume.data_services and "
                "encryption_key unset"
            )
        async with self._changes.hold():
            snap = await self._owned_snapshot(source)
            size = spec.size_bytes or snap.size_bytes
            self._check_size(size, snap.block_size)
            await self._check_quota(snap.tenant, 1, size)
            info = await in_thread(
                lambda: self._store.clone(
                    source, request.volume_id, size, tenant=snap.tenant, qos=qos_from(spec.qos)
                )
            )
        return to_proto(info)

    async def GetVolume(
        self, request: storage_pb2.GetVolumeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> storage_pb2.Volume:
        """One volume with its statistics."""
        return await self._volume(volume_id(request.name))

    async def ListVolumes(
        self, request: storage_pb2.ListVolumesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> storage_pb2.ListVolumesResponse:
        """A page of the caller's volumes (an admin's: every volume) in id order."""
        volumes = await in_thread(self._store.list, _listed_tenant())
        page, token = paging.page(volumes, lambda v: v.volume_id, request)
        return storage_pb2.ListVolumesResponse(
            volumes=[to_proto(v) for v in page], next_page_token=token
        )

    async def UpdateVolume(
        self, request: storage_pb2.UpdateVolumeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> storage_pb2.Volume:
        """Change a volume's QoS limits (the fields the update mask names)."""
        ident = volume_id(request.volume.name)
        paths = list(request.update_mask.paths) or ["qos"]
        fields: set[str] = set()
        for path in paths:
            if path not in _UPDATABLE:
                raise InvalidArgument(
                    f"update_mask: cannot update {path!r} (only {', '.join(sorted(_UPDATABLE))})"
                )
            fields.update(_UPDATABLE[path])
        async with self._changes.hold():
            info = await self._owned(ident)
            given = request.volume.qos
            qos = QosLimits(
                **{
                    f: getattr(given, f) if f in fields else getattr(info.qos, f)
                    for f in QOS_FIELDS
                }
            )
            updated = await in_thread(self._store.set_qos, ident, qos)
        stats = await in_thread(self._store.stats, ident)
        return to_proto(updated, stats)

    async def ResizeVolume(
        self, request: storage_pb2.ResizeVolumeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> storage_pb2.Volume:
        """Grow a volume, or shrink it (over written data only with force)."""
        ident = volume_id(request.name)
        async with self._changes.hold():
            info = await self._owned(ident)
            self._check_size(request.size_bytes, info.block_size)
            if request.size_bytes > info.size_bytes:
                await self._check_quota(info.tenant, 0, request.size_bytes - info.size_bytes)
            resized = await in_thread(
                lambda: self._store.resize(ident, request.size_bytes, force=request.force)
            )
        return to_proto(resized)

    async def DeleteVolume(
        self, request: storage_pb2.DeleteVolumeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> storage_pb2.DeleteVolumeResponse:
        """Delete a volume and its data (its snapshots stay)."""
        ident = volume_id(request.name)
        async with self._changes.hold():
            await self._owned(ident)
            await in_thread(self._store.delete, ident)
        return storage_pb2.DeleteVolumeResponse()

    # ------------------------------------------------------------ snapshots

    async def CreateSnapshot(
        self,
        request: storage_pb2.CreateSnapshotRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> storage_pb2.Snapshot:
        """A read-only point-in-time snapshot of a volume."""
        source = resource_id(request.snapshot.source_volume, "volumes", "snapshot.source_volume")
        async with self._changes.hold():
            volume = await self._owned(source)
            held = (await in_thread(self._store.stats, source)).allocated_bytes
            await self._check_quota(volume.tenant, 0, held, 1)  # the snapshot takes them over
            info = await in_thread(self._store.create_snapshot, source, request.snapshot_id)
        return snapshot_to(info)

    async def GetSnapshot(
        self, request: storage_pb2.GetSnapshotRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> storage_pb2.Snapshot:
        """One snapshot."""
        return snapshot_to(await self._owned_snapshot(snapshot_id(request.name)))

    async def ListSnapshots(
        self,
        request: storage_pb2.ListSnapshotsRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> storage_pb2.ListSnapshotsResponse:
        """A page of the caller's snapshots (an admin's: every one), of one volume if asked."""
        source = ""
        if request.source_volume:
            source = resource_id(request.source_volume, "volumes", "source_volume")
        snaps = [
            s
            for s in await in_thread(self._store.list_snapshots, _listed_tenant())
            if not source or s.source_volume == source
        ]
        page, token = paging.page(snaps, lambda s: s.snapshot_id, request)
        return storage_pb2.ListSnapshotsResponse(
            snapshots=[snapshot_to(s) for s in page], next_page_token=token
        )

    async def DeleteSnapshot(
        self,
        request: storage_pb2.DeleteSnapshotRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> storage_pb2.DeleteSnapshotResponse:
        """Delete a snapshot (FAILED_PRECONDITION while it has clones)."""
        ident = snapshot_id(request.name)
        async with self._changes.hold():
            await self._owned_snapshot(ident)
            await in_thread(self._store.delete_snapshot, ident)
        return storage_pb2.DeleteSnapshotResponse()

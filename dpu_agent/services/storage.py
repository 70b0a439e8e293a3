"""StorageService: block volumes on the DPU (a thin gRPC layer over the volume store).

Every volume belongs to the tenant that created it (kept in the store's catalog). A
tenant sees, resizes and deletes only its own volumes; another tenant's volume answers
NOT_FOUND exactly as a missing one does. Admins see all. Create and resize are held to
the tenant's quota (`[quota] max_volumes`, `max_volume_bytes`).
"""

from __future__ import annotations

import asyncio
import collections
from typing import TYPE_CHECKING, Any, Final

from dpu_agent import auth, paging
from dpu_agent.errors import InvalidArgument
from dpu_agent.quota import Quotas
from dpu_agent.services.convert import timestamp
from dpu_agent.storage import Compression, DataServices, Encryption
from dpu_wire import names
from dpu_wire.v1 import common_pb2, storage_pb2, storage_pb2_grpc

if TYPE_CHECKING:
    import grpc

    from dpu_agent.storage import VolumeInfo, VolumeStats, VolumeStore

MAX_REMEMBERED_CREATES: Final = 4096  # request ids kept for idempotent CreateVolume

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


def volume_id(name: str) -> str:
    """The id in "volumes/{id}"."""
    (ident,) = names.parse_name(name, "volumes")
    return ident


def to_proto(info: VolumeInfo, stats: VolumeStats | None = None) -> storage_pb2.Volume:
    """The API form of a volume (never its key)."""
    volume = storage_pb2.Volume(
        name=f"volumes/{info.volume_id}",
        size_bytes=info.size_bytes,
        block_size=info.block_size,
        data_services=storage_pb2.DataServices(
            crc32c=info.services.crc32c,
            compression=_COMPRESSION_OUT[info.services.compression],
            encryption=_ENCRYPTION_OUT[info.services.encryption],
        ),
        tenant=info.tenant,
        times=common_pb2.ResourceTimes(
            create_time=timestamp(info.create_ns), update_time=timestamp(info.update_ns)
        ),
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
            )
        )
    return volume


class StorageService(storage_pb2_grpc.StorageServiceServicer):
    """Create, inspect, resize and delete volumes; the store does the work in a thread."""

    def __init__(self, store: VolumeStore, quotas: Quotas | None = None) -> None:
        self._store = store
        self._quotas = quotas or Quotas()
        # (tenant, request_id) -> volume id, for idempotent create; oldest forgotten first
        self._created: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()
        self._changes = asyncio.Lock()  # create/resize/delete: ownership and quota checks hold

    async def _owned(self, ident: str) -> VolumeInfo:
        """The volume, if the caller may see it; NotFound as for a missing one otherwise."""
        info = await asyncio.to_thread(self._store.get, ident)
        auth.check_owner(info.tenant, f"volume {ident!r}")  # the store's own not-found text
        return info

    async def _volume(self, ident: str) -> storage_pb2.Volume:
        info = await self._owned(ident)
        stats = await asyncio.to_thread(self._store.stats, ident)
        return to_proto(info, stats)

    async def _tenant_volumes(self, tenant: str) -> list[VolumeInfo]:
        return [v for v in await asyncio.to_thread(self._store.list) if v.tenant == tenant]

    async def CreateVolume(
        self, request: storage_pb2.CreateVolumeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> storage_pb2.Volume:
        """Create a volume with its data services; the key is sealed, never returned."""
        tenant = auth.tenant()
        remembered = (tenant, request.request_id)
        if request.request_id and remembered in self._created:
            return await self._volume(self._created[remembered])
        spec = request.volume
        if spec.size_bytes == 0:
            raise InvalidArgument("volume.size_bytes is required")
        services = DataServices(
            crc32c=spec.data_services.crc32c,
            compression=_COMPRESSION[spec.data_services.compression],
            encryption=_ENCRYPTION[spec.data_services.encryption],
        )
        async with self._changes:
            owned = await self._tenant_volumes(tenant)
            self._quotas.check_volumes(
                tenant, len(owned) + 1, sum(v.size_bytes for v in owned) + spec.size_bytes
            )
            info = await asyncio.to_thread(
                lambda: self._store.create(
                    request.volume_id,
                    spec.size_bytes,
                    spec.block_size or 4096,
                    services,
                    request.encryption_key or None,
                    tenant=tenant,
                )
            )
        if request.request_id:
            self._created[remembered] = info.volume_id
            while len(self._created) > MAX_REMEMBERED_CREATES:
                self._created.popitem(last=False)
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
        principal = auth.current_principal()
        volumes = [
            v for v in await asyncio.to_thread(self._store.list) if principal.can_see(v.tenant)
        ]
        page, token = paging.page(
            volumes, lambda v: v.volume_id, request.page_size, request.page_token
        )
        return storage_pb2.ListVolumesResponse(
            volumes=[to_proto(v) for v in page], next_page_token=token
        )

    async def ResizeVolume(
        self, request: storage_pb2.ResizeVolumeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> storage_pb2.Volume:
        """Grow a volume, or shrink it (over written data only with force)."""
        ident = volume_id(request.name)
        async with self._changes:
            info = await self._owned(ident)
            if request.size_bytes > info.size_bytes:
                owned = await self._tenant_volumes(info.tenant)
                total = sum(v.size_bytes for v in owned) - info.size_bytes + request.size_bytes
                self._quotas.check_volumes(info.tenant, len(owned), total)
            resized = await asyncio.to_thread(
                lambda: self._store.resize(ident, request.size_bytes, force=request.force)
            )
        return to_proto(resized)

    async def DeleteVolume(
        self, request: storage_pb2.DeleteVolumeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> storage_pb2.DeleteVolumeResponse:
        """Delete a volume and its data."""
        ident = volume_id(request.name)
        async with self._changes:
            await self._owned(ident)
            await asyncio.to_thread(self._store.delete, ident)
        return storage_pb2.DeleteVolumeResponse()

"""A tenant's storage calls describe only its own volumes and snapshots.

Every change of the StorageService weighs the caller's quota, and every List answers
the caller's objects. Both listed the whole store, every tenant's objects made into
infos and sorted, under the store's lock: with 16 tenants at their quotas (16,384
volumes and as many snapshots) one walk took 50-160 ms, and one tenant walking in a
loop held another tenant's 4 KiB writes from 0.07 ms to 13-42 ms (median). The store
keeps an index by tenant (`State.of`), so a tenant's walk is as long as its own list.
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import pytest

from dpu_agent import auth
from dpu_agent.services.storage import StorageService
from dpu_agent.storage import MemoryVolumeStore
from dpu_agent.storage.state import Node
from dpu_wire.v1 import storage_pb2

OTHERS = 40  # tenant a's volumes, each with a snapshot
CONTEXT: Any = None


def _as(tenant: str, *, admin: bool = False) -> contextvars.Context:
    context = contextvars.copy_context()
    context.run(auth.principal.set, auth.Principal(tenant, admin=admin))
    return context


def _create(volume_id: str) -> storage_pb2.CreateVolumeRequest:
    return storage_pb2.CreateVolumeRequest(
        volume_id=volume_id, volume=storage_pb2.Volume(size_bytes=1 << 20)
    )


def _snapshot(snapshot_id: str, volume_id: str) -> storage_pb2.CreateSnapshotRequest:
    return storage_pb2.CreateSnapshotRequest(
        snapshot_id=snapshot_id,
        snapshot=storage_pb2.Snapshot(source_volume=f"volumes/{volume_id}"),
    )


@pytest.mark.asyncio
async def test_another_tenants_objects_are_not_described(monkeypatch):
    loop = asyncio.get_running_loop()

    async def run(tenant: str, call: Any, *, admin: bool = False) -> Any:
        return await loop.create_task(call, context=_as(tenant, admin=admin))

    with MemoryVolumeStore() as store:
        service = StorageService(store)
        for i in range(OTHERS):
            await run("a", service.CreateVolume(_create(f"a-{i}"), CONTEXT))
            await run("a", service.CreateSnapshot(_snapshot(f"a-snap-{i}", f"a-{i}"), CONTEXT))
        described: list[str] = []
        for method in ("volume_info", "snapshot_info"):
            real = getattr(Node, method)

            def counted(node: Node, real: Any = real) -> Any:
                described.append(node.name)
                return real(node)

            monkeypatch.setattr(Node, method, counted)
        await run("b", service.CreateVolume(_create("b-0"), CONTEXT))
        await run("b", service.CreateSnapshot(_snapshot("b-snap", "b-0"), CONTEXT))
        await run(
            "b",
            service.ResizeVolume(
                storage_pb2.ResizeVolumeRequest(name="volumes/b-0", size_bytes=2 << 20), CONTEXT
            ),
        )
        volumes = await run("b", service.ListVolumes(storage_pb2.ListVolumesRequest(), CONTEXT))
        snaps = await run("b", service.ListSnapshots(storage_pb2.ListSnapshotsRequest(), CONTEXT))
        assert [v.name for v in volumes.volumes] == ["volumes/b-0"]
        assert [s.name for s in snaps.snapshots] == ["snapshots/b-snap"]
        assert not [name for name in described if name.startswith("a-")]
        every = await run(
            "ops", service.ListSnapshots(storage_pb2.ListSnapshotsRequest(), CONTEXT), admin=True
        )
        assert len(every.snapshots) == OTHERS + 1  # an admin's list still has them all

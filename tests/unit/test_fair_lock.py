"""Tenants take the services' check-and-change locks in turns (dpu_agent/fair_lock.py)."""

from __future__ import annotations

import asyncio
import contextvars
import time

import pytest

from dpu_agent import auth
from dpu_agent.fair_lock import FairLock
from dpu_agent.services.storage import StorageService
from dpu_agent.storage import MemoryVolumeStore, QosLimits, VolumeInfo
from dpu_wire.v1 import storage_pb2

FLOOD = 40  # one tenant's calls queued at once
SLOW_S = 0.02  # each holds the lock this long


def _as(tenant: str) -> contextvars.Context:
    context = contextvars.copy_context()
    context.run(auth.principal.set, auth.Principal(tenant))
    return context


class _SlowStore(MemoryVolumeStore):
    """A store whose QoS changes take SLOW_S (a sync of the metadata log, say)."""

    def set_qos(self, volume_id: str, qos: QosLimits) -> VolumeInfo:
        time.sleep(SLOW_S)
        return super().set_qos(volume_id, qos)


def _update(name: str, iops: int) -> storage_pb2.UpdateVolumeRequest:
    return storage_pb2.UpdateVolumeRequest(
        volume=storage_pb2.Volume(name=name, qos=storage_pb2.QosLimits(read_iops=iops))
    )


@pytest.mark.asyncio
async def test_a_tenants_queued_changes_do_not_hold_another_tenants_change():
    """Tenant a queues FLOOD UpdateVolume calls; tenant b's one call waits for at most
    two of them. With one asyncio.Lock for everyone, b's call came after all 40."""
    loop = asyncio.get_running_loop()
    with _SlowStore() as store:
        service = StorageService(store)
        for tenant in ("a", "b"):
            create = storage_pb2.CreateVolumeRequest(
                volume_id=f"{tenant}-vol", volume=storage_pb2.Volume(size_bytes=1 << 20)
            )
            await loop.create_task(service.CreateVolume(create, None), context=_as(tenant))  # type: ignore[arg-type]
        done: list[str] = []

        async def update(tenant: str, iops: int) -> None:
            await service.UpdateVolume(_update(f"volumes/{tenant}-vol", iops), None)  # type: ignore[arg-type]
            done.append(tenant)

        flood = [loop.create_task(update("a", i + 1), context=_as("a")) for i in range(FLOOD)]
        await asyncio.sleep(0)  # a's calls are queued first
        await loop.create_task(update("b", 1), context=_as("b"))
        assert done.index("b") <= 2, f"b's change came after {done.index('b')} of a's"
        await asyncio.gather(*flood)
        assert done.count("a") == FLOOD  # every one of a's calls ran in the end


@pytest.mark.asyncio
async def test_one_holder_at_a_time_and_a_tenants_calls_in_order():
    lock = FairLock()
    order: list[tuple[str, int]] = []
    holders = 0

    async def hold(tenant: str, index: int) -> None:
        nonlocal holders
        async with lock.hold():
            holders += 1
            assert holders == 1
            await asyncio.sleep(0.001)
            order.append((tenant, index))
            holders -= 1

    loop = asyncio.get_running_loop()
    calls = [
        loop.create_task(hold(tenant, i), context=_as(tenant))
        for i in range(5)
        for tenant in ("a", "b")
    ]
    await asyncio.gather(*calls)
    for tenant in ("a", "b"):
        assert [i for t, i in order if t == tenant] == list(range(5))
    assert not lock.locked()


@pytest.mark.asyncio
async def test_a_cancelled_waiter_frees_its_place():
    lock = FairLock()
    loop = asyncio.get_running_loop()
    async with lock.hold():
        waiter = loop.create_task(lock.hold().__aenter__(), context=_as("a"))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
    async with asyncio.timeout(1):
        await loop.create_task(_enter_and_leave(lock), context=_as("a"))


async def _enter_and_leave(lock: FairLock) -> None:
    async with lock.hold():
        pass

"""The services' blocking calls share the executor fairly among tenants (offload.py)."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from pathlib import Path

import pytest

from dpu_agent import auth, offload

FLOOD = 40  # a tenant's concurrent calls: far more than the executor's threads


def _as(tenant: str) -> contextvars.Context:
    context = contextvars.copy_context()
    context.run(auth.principal.set, auth.Principal(tenant))
    return context


@pytest.mark.asyncio
async def test_a_tenants_flood_of_blocked_calls_leaves_another_tenant_served():
    """Tenant a's calls all block in their threads; tenant b's call still runs at once,
    and no more than PER_TENANT of a's ever started. Straight `asyncio.to_thread`, a's
    calls took every thread and filled the queue, and b's never ran while they blocked."""
    release = threading.Event()
    started = 0
    lock = threading.Lock()

    def blocked() -> None:
        nonlocal started
        with lock:
            started += 1
        release.wait(30)

    loop = asyncio.get_running_loop()
    flood = [loop.create_task(offload.in_thread(blocked), context=_as("a")) for _ in range(FLOOD)]
    try:
        await asyncio.sleep(0.2)  # a's calls reach the executor (or their turn's queue)
        served = loop.create_task(offload.in_thread(lambda: "b's answer"), context=_as("b"))
        assert await asyncio.wait_for(served, 10) == "b's answer"
        assert started <= offload.PER_TENANT
    finally:
        release.set()
        await asyncio.gather(*flood)
    assert started == FLOOD  # every one of a's calls ran in the end, none was refused


@pytest.mark.asyncio
async def test_a_tenants_calls_run_in_arrival_order_past_its_share():
    order: list[int] = []
    calls = [
        asyncio.get_running_loop().create_task(offload.in_thread(order.append, i), context=_as("a"))
        for i in range(3 * offload.PER_TENANT)
    ]
    await asyncio.gather(*calls)
    # The first PER_TENANT run together in any order; later ones wait their turn in order.
    assert sorted(order) == list(range(3 * offload.PER_TENANT))
    assert order[offload.PER_TENANT * 2 :] == sorted(order[offload.PER_TENANT * 2 :])


@pytest.mark.asyncio
async def test_an_error_in_the_call_is_raised_and_frees_its_place():
    def fail() -> None:
        raise ValueError("from the thread")

    for _ in range(2 * offload.PER_TENANT):  # a leaked place would block the last ones
        with pytest.raises(ValueError, match="from the thread"):
            await asyncio.wait_for(offload.in_thread(fail), 10)


def test_the_services_run_their_blocking_calls_through_the_fair_gate():
    """A service calling `asyncio.to_thread` itself would bypass the tenants' shares."""
    services = Path(offload.__file__).parent / "services"
    bypassing = [p.name for p in services.glob("*.py") if "to_thread(" in p.read_text()]
    assert bypassing == []

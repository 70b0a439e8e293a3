"""The services' blocking calls, run in threads fairly among tenants.

The gRPC services run their blocking work (the volume store, tc, configfs and the
kernel's block devices) in the event loop's default executor, whose few threads
every tenant shares. `in_thread` is how they do it: a tenant has at most
`PER_TENANT` such calls queued or running in the executor at once, and its other
calls wait their turn in arrival order (an asyncio.Semaphore is first come, first
served). Without it, one tenant with a thousand concurrent calls filled the
executor's queue ahead of everyone else: another tenant's GetVolume went from about
1 ms to 0.7 s.

A call outside an RPC (no principal: start-up, background work) counts as the tenant
"". The gates are per event loop (a semaphore belongs to one loop) and are kept
for the loop's life, one per tenant that made a call.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import TYPE_CHECKING, Final, ParamSpec, TypeVar

from dpu_agent import auth

if TYPE_CHECKING:
    from collections.abc import Callable

PER_TENANT: Final = 4  # a tenant's calls in the executor at once; the default has 6 threads
_P = ParamSpec("_P")
_T = TypeVar("_T")
_gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Semaphore]] = (
    weakref.WeakKeyDictionary()
)


def _gate(tenant: str) -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    gates = _gates.get(loop)
    if gates is None:
        gates = _gates[loop] = {}
    gate = gates.get(tenant)
    if gate is None:
        gate = gates[tenant] = asyncio.Semaphore(PER_TENANT)
    return gate


async def in_thread(fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """`asyncio.to_thread(fn, ...)`, behind the caller's tenant's share of the executor."""
    async with _gate(auth.caller_tenant()):
        return await asyncio.to_thread(fn, *args, **kwargs)

"""An asyncio lock that tenants take in turns (the services' check-and-change locks).

The StorageService and the NetworkService hold one lock while they check a quota and
make the change, so that two calls cannot both slip under a limit. A plain
asyncio.Lock serves its waiters in arrival order whoever they are: a tenant with a
thousand calls queued on it was ahead of another tenant's one call, which waited for
all of them (1,000 UpdateVolume calls of one tenant held another's for 1.4 s, 4,000
for 7.5 s). `FairLock` puts a lock of the caller's tenant in front of the shared one:
a tenant's calls queue on its own lock, at most one of them waits on the shared lock,
and a call of another tenant waits for at most one call of each tenant ahead of it.

A call outside an RPC (no principal) counts as the tenant "". The tenants' locks are
kept for the lock's life, one per tenant that took it (as `dpu_agent.offload`'s gates).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from dpu_agent import auth

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


class FairLock:
    """One holder at a time; waiting tenants take turns (single-threaded: one event loop)."""

    def __init__(self) -> None:
        self._shared = asyncio.Lock()
        self._tenants: dict[str, asyncio.Lock] = {}

    def locked(self) -> bool:
        """Whether a call holds the lock."""
        return self._shared.locked()

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """Hold the lock, after the caller's tenant's earlier calls and one of each other's."""
        tenant = auth.caller_tenant()
        own = self._tenants.get(tenant)
        if own is None:
            own = self._tenants[tenant] = asyncio.Lock()
        async with own, self._shared:
            yield

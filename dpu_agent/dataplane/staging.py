"""Staging memory: the DPU-side buffers jobs READ into and WRITE from.

Each session registers two regions once, when its data plane connects, and carves
them into buffers: small ones (`SMALL` bytes, two per open job up to `MAX_SMALL`), so a
job whose transfers all fit one never waits for memory, and a few large ones
(`chunk_size` bytes) that larger jobs take turns on, chunk by chunk. What a session can
pin is therefore fixed when it opens, whatever its jobs declare:
`min(2 * queue_depth, MAX_SMALL) * SMALL + large * chunk_size`.

A buffer goes back to its pool only once no operation can still touch it: a job that
ends (cancelled, deadline) while an RDMA operation on its buffer is in flight leaves
the buffer out until that operation completes, so the NIC never writes into memory
another job already uses.
"""

from __future__ import annotations

import collections
import contextlib
from typing import TYPE_CHECKING, Final, NamedTuple

if TYPE_CHECKING:
    from collections.abc import Callable

    from dpu_wire.transport.base import AgentLink, Region

SMALL: Final = 64 << 10
MAX_SMALL: Final = 128


class Buffer(NamedTuple):
    """`size` bytes of a staging region, from `offset`."""

    region: Region
    offset: int
    size: int

    @property
    def view(self) -> memoryview:
        """The bytes."""
        return self.region.view[self.offset : self.offset + self.size]


class Waiter:
    """A job waiting for `count` buffers: `ready` gets them."""

    __slots__ = ("count", "ready")

    def __init__(self, count: int, ready: Callable[[list[Buffer]], None]) -> None:
        self.count = count
        self.ready = ready


class _Pool:
    def __init__(self, link: AgentLink, count: int, size: int) -> None:
        self.size = size
        self.count = count
        self.region = link.staging(count * size)
        self.free = [Buffer(self.region, i * size, size) for i in range(count)]
        self.waiting: collections.deque[Waiter] = collections.deque()


class Staging:
    """A session's staging buffers (used on the reactor thread only)."""

    def __init__(self, link: AgentLink, *, queue_depth: int, chunk_size: int, large: int) -> None:
        self._link = link
        self.chunk_size = chunk_size
        small = min(2 * queue_depth, MAX_SMALL)
        self._small = _Pool(link, small, min(SMALL, chunk_size))
        self._large = _Pool(link, max(1, large), chunk_size)
        self._serving = False  # give_back is serving waiters
        self.pinned = sum(pool.count * pool.size for pool in (self._small, self._large))

    def pool_for(self, largest_transfer: int) -> int:
        """The buffer size a job moving at most `largest_transfer` bytes at once gets."""
        if largest_transfer <= self._small.size:
            return self._small.size
        return self._large.size

    def _pool(self, size: int) -> _Pool:
        """The pool of buffers of `size` (a `pool_for` answer)."""
        return self._small if size == self._small.size else self._large

    def capacity(self, size: int) -> int:
        """How many buffers of `size` (a `pool_for` answer) the session has in all."""
        return self._pool(size).count

    def take(self, size: int, count: int, ready: Callable[[list[Buffer]], None]) -> Waiter | None:
        """Hand `count` buffers of `size` to `ready` now, or as soon as they are free.

        Returns None when `ready` got them at once, else its place in the queue, for
        `forget` if it stops waiting.
        """
        pool = self._pool(size)
        if not pool.waiting and len(pool.free) >= count:
            ready([pool.free.pop() for _ in range(count)])
            return None
        waiter = Waiter(count, ready)
        pool.waiting.append(waiter)
        return waiter

    def forget(self, waiter: Waiter) -> None:
        """Take a waiter out of its queue (its job ended before its turn came)."""
        for pool in (self._small, self._large):
            with contextlib.suppress(ValueError):
                pool.waiting.remove(waiter)
                return

    def give_back(self, buffers: list[Buffer]) -> None:
        """Return buffers no operation uses any more; serve who waits, in order.

        Not again from inside: a job served here may end at once and give its buffers
        back, and the loop here hands them on, where a nested call per job would
        exhaust the stack with a long queue.
        """
        for buffer in buffers:
            self._pool(buffer.size).free.append(buffer)
        if self._serving:
            return
        self._serving = True
        try:
            served = True
            while served:
                served = False
                for pool in (self._small, self._large):
                    while pool.waiting and len(pool.free) >= pool.waiting[0].count:
                        waiter = pool.waiting.popleft()
                        waiter.ready([pool.free.pop() for _ in range(waiter.count)])
                        served = True
        finally:
            self._serving = False

    def drop_waiters(self) -> None:
        """Forget who waits (the session is closing)."""
        for pool in (self._small, self._large):
            pool.waiting.clear()

    def close(self) -> None:
        """Release the regions (the link is closed, or nothing is in flight)."""
        for pool in (self._small, self._large):
            self._link.release(pool.region)
            pool.free.clear()

"""Test harness: both ends of a data-plane link, driven as the agent and the SDK drive them.

`AgentEnd` puts an `AgentLink` on a real `Reactor` thread (the agent's data-plane loop)
and gives a test awaitable operations: `read`, `write` and `send` post on the reactor
and resolve when the link reports the token done; `recv` returns the capsules the link
delivered. `HostEnd` starts a `HostLink` on the test's event loop and queues what it
receives. `tcp_pair()` and `verbs_pair()` make a connected pair.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import os
import types
from typing import TYPE_CHECKING, Any, Final, cast

from dpu_agent.dataplane.pipeline import Pipeline, SessionHooks
from dpu_agent.dataplane.reactor import Reactor
from dpu_agent.dataplane.regions import AdvertisedRegion, RegionTable
from dpu_agent.dataplane.staging import Staging
from dpu_agent.errors import Unavailable
from dpu_wire.capsule import MAX_CAPSULE
from dpu_wire.transport import tcp
from dpu_wire.transport.base import Access, AgentLink, LinkSink, TransportError

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from dpu_wire.transport.base import HostLink, PeerAddress, Region


class StandInLink(AgentLink):
    """An `AgentLink` for tests of the reactor: an eventfd as its descriptor, nothing
    posted; a subclass says what `poll` hands over. `in_flight` is its `outstanding`."""

    def __init__(self, readable: bool = False) -> None:
        self.error = None
        self.in_flight = 0
        self._fd = os.eventfd(int(readable), os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    @property
    def address(self) -> PeerAddress | None:
        return None

    def staging(self, length: int) -> Region:
        raise NotImplementedError

    def release(self, region: Region) -> None:
        raise NotImplementedError

    def fileno(self) -> int:
        return self._fd

    def on_event(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._fd)

    @property
    def outstanding(self) -> int:
        return self.in_flight

    def room(self) -> int:
        return 0

    def post_read(
        self, local: Region, offset: int, length: int, addr: int, rkey: int, token: int
    ) -> None:
        raise NotImplementedError

    def post_write(
        self, local: Region, offset: int, length: int, addr: int, rkey: int, token: int | None
    ) -> None:
        raise NotImplementedError

    def post_send(self, capsule: bytes, token: int | None = None) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        pass

    def poll(self, sink: LinkSink, budget: int) -> int:
        raise NotImplementedError

    def arm(self, sink: LinkSink) -> bool:  # noqa: ARG002 - nothing slips in
        return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class BacklogLink(StandInLink):
    """A readiness-driven link whose capsules (`name` and a number) are all in its buffer
    from the start: its descriptor is readable once (the read that brought them), and
    never again; `poll` hands over a budget of them, as a tcp link does."""

    def __init__(self, name: str, count: int) -> None:
        super().__init__(readable=True)
        self.waiting = [f"{name}{i}".encode() for i in range(count)]

    def poll(self, sink: LinkSink, budget: int) -> int:
        taken, self.waiting = self.waiting[:budget], self.waiting[budget:]
        for capsule in taken:
            sink.on_capsule(memoryview(capsule))
        return len(taken)

    @property
    def backlog(self) -> bool:
        return bool(self.waiting)


class StandInHooks:
    """A pipeline's session for tests: records what it publishes and its failure;
    `draining` refuses jobs; `volumes` maps attached handles to volume ids."""

    def __init__(self, volumes: dict[int, str] | None = None) -> None:
        self.published: list[Any] = []
        self.failure: Exception | None = None
        self.draining = False
        self.volumes = volumes or {}

    def check_accepting(self) -> None:
        if self.draining:
            raise Unavailable("the agent is shutting down and takes no new jobs")

    def ready(self) -> bool:
        return not self.draining

    def finished(self, jobs: list[object]) -> None:
        self.published.extend(jobs)

    def rejected(self) -> None:
        pass

    def volume_of(self, handle: int) -> str | None:
        return self.volumes.get(handle)

    def data_plane_failed(self, error: Exception) -> None:
        self.failure = error


class StandInReactor:
    """A pipeline's reactor for tests: its timers never fire."""

    def wake(self, _link: object) -> None:
        pass

    def call_later(self, _seconds: float, _fn: object) -> object:
        return types.SimpleNamespace(cancel=lambda: None)


class RecordingLink:
    """A pipeline's link for tests: records the READs and SENDs posted, accepts the rest."""

    inline_max = 0
    error = None
    outstanding = 0

    def __init__(self) -> None:
        self.reads: list[int] = []  # the token of each READ posted
        self.sent: list[bytes] = []  # each capsule sent (COMPLETIONs)

    def staging(self, length: int) -> object:
        return types.SimpleNamespace(view=memoryview(bytearray(length)))

    def release(self, _region: Region) -> None:
        pass

    def fast_regions(self, _regions: object, _sink: object) -> bool:
        return False

    def room(self) -> int:
        return 1 << 20

    def post_read(self, *operands: object) -> None:
        self.reads.append(cast("int", operands[-1]))

    def post_send(self, message: bytes, _token: int | None = None) -> None:
        self.sent.append(bytes(message))

    def flush(self) -> None:
        pass


SOURCE: Final = AdvertisedRegion("src", 0x100000, 1 << 20, 1, Access.REMOTE_READ)
DESTINATION: Final = AdvertisedRegion("dst", 0x200000, 1 << 20, 2, Access.REMOTE_WRITE)


def stand_in_pipeline(
    queue_depth: int, chunk_size: int = 1 << 20, large: int = 4
) -> tuple[Pipeline, RecordingLink]:
    """A session's pipeline on a `RecordingLink`, with a readable region `SOURCE` (rkey 1)
    and a writable one `DESTINATION` (rkey 2) of 1 MiB each; its timers never fire."""
    link = RecordingLink()
    regions = RegionTable()
    regions.add(SOURCE)
    regions.add(DESTINATION)
    staging = Staging(
        cast("AgentLink", link), queue_depth=queue_depth, chunk_size=chunk_size, large=large
    )
    pipe = Pipeline(
        hooks=cast("SessionHooks", StandInHooks()),
        link=cast("AgentLink", link),
        reactor=cast("Reactor", StandInReactor()),
        staging=staging,
        regions=regions,
        storage=None,
        queue_depth=queue_depth,
        default_deadline=30.0,
    )
    return pipe, link


class NoStaging:
    """A pipeline's staging for tests whose jobs take no buffer (inline, trims, the
    core's): no job ever waits for one, so ending the session drops no waiter."""

    def drop_waiters(self) -> None:
        pass

    def close(self) -> None:
        pass


class StandInOwner(LinkSink):
    """A session for tests of the reactor: it is its own sink and posts nothing; a
    subclass says what to do with each capsule."""

    futile = 0  # LinkOwner: nothing these charge a tenant

    @property
    def sink(self) -> LinkSink:
        return self

    def end_pass(self) -> None:
        pass

    def link_failed(self) -> None:
        pass

    def on_capsule(self, data: memoryview) -> None:
        raise NotImplementedError

    def on_done(self, token: int, error: TransportError | None) -> None:
        raise AssertionError(f"nothing was posted ({token}, {error})")


class AgentEnd(LinkSink):
    """An agent link on a reactor, with awaitable operations for tests."""

    def __init__(self, link: AgentLink, reactor: Reactor) -> None:
        self.link = link
        self.reactor = reactor
        self._loop = asyncio.get_running_loop()
        self._tokens = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[None]] = {}
        self.capsules: asyncio.Queue[bytes | TransportError] = asyncio.Queue()
        self.failed: TransportError | None = None
        self._sends: collections.deque[tuple[bytes, int]] = collections.deque()

    # LinkOwner (reactor thread)
    futile = 0  # LinkOwner: nothing these charge a tenant

    @property
    def sink(self) -> LinkSink:
        return self

    def end_pass(self) -> None:
        while self._sends and self.link.room() and self.link.error is None:
            capsule, token = self._sends.popleft()
            self.link.post_send(capsule, token)
            self.reactor.wake(self.link)
        self.link.flush()

    def link_failed(self) -> None:
        if self.failed is None and self.link.error is not None:
            self.failed = self.link.error
            self._loop.call_soon_threadsafe(self.capsules.put_nowait, self.link.error)

    # LinkSink (reactor thread)
    def on_capsule(self, data: memoryview) -> None:
        self._loop.call_soon_threadsafe(self.capsules.put_nowait, bytes(data))

    def on_done(self, token: int, error: TransportError | None) -> None:
        future = self._waiting.pop(token, None)
        if future is not None:
            self._loop.call_soon_threadsafe(_settle, future, error)

    # the test's side
    async def start(self) -> None:
        await self.reactor.call_async(lambda: self.reactor.add(self.link, self))

    async def _op(self, post: object) -> None:
        token = next(self._tokens)
        future = self._loop.create_future()
        self._waiting[token] = future

        def run() -> None:
            try:
                post(token)  # type: ignore[operator]
            except Exception as exc:  # noqa: BLE001 - handed to the test
                self._waiting.pop(token, None)
                self._loop.call_soon_threadsafe(_settle, future, exc)
                return
            self.reactor.wake(self.link)

        self.reactor.call(run)
        await future

    async def read(self, local: Region, offset: int, length: int, addr: int, rkey: int) -> None:
        """RDMA READ into `local[offset:]`; raises the link's error."""
        await self._op(lambda t: self.link.post_read(local, offset, length, addr, rkey, t))

    async def write(self, local: Region, offset: int, length: int, addr: int, rkey: int) -> None:
        """RDMA WRITE from `local[offset:]`; raises the link's error."""
        await self._op(lambda t: self.link.post_write(local, offset, length, addr, rkey, t))

    async def send(self, capsule: bytes) -> None:
        """SEND a capsule (queued while the send ring is full); returns once it is done."""

        def post(token: int) -> None:
            if self._sends or not self.link.room():
                if len(capsule) > MAX_CAPSULE:
                    raise ValueError(f"capsule of {len(capsule)} bytes exceeds {MAX_CAPSULE}")
                self._sends.append((capsule, token))
            else:
                self.link.post_send(capsule, token)

        await self._op(post)

    async def recv(self) -> bytes:
        """The next capsule; the link's error once it failed."""
        item = await self.capsules.get()
        if isinstance(item, TransportError):
            self.capsules.put_nowait(item)
            raise item
        return item

    def staging(self, length: int) -> Region:
        """A staging region of the link."""
        return self.link.staging(length)

    async def close(self) -> None:
        """Take the link off the reactor and close it."""

        def run() -> None:
            self.reactor.remove(self.link)
            self.link.close()

        await self.reactor.call_async(run)
        for future in self._waiting.values():
            _settle(future, TransportError("closed"))


class HostEnd:
    """A host link started on this loop, queueing what it receives."""

    def __init__(self, link: HostLink) -> None:
        self.link = link
        self.capsules: asyncio.Queue[bytes | TransportError] = asyncio.Queue()
        self.expecting = False

    def start(self) -> None:
        self.link.start(self._capsule, self._failure, lambda: self.expecting)

    def _capsule(self, data: memoryview) -> None:
        self.capsules.put_nowait(bytes(data))

    def _failure(self, error: TransportError) -> None:
        self.capsules.put_nowait(error)

    def send(self, capsule: bytes) -> None:
        self.link.send([capsule])

    async def recv(self) -> bytes:
        self.expecting = True
        try:
            item = await self.capsules.get()
        finally:
            self.expecting = False
        if isinstance(item, TransportError):
            self.capsules.put_nowait(item)
            raise item
        return item

    async def close(self) -> None:
        await self.link.close()


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


@contextlib.asynccontextmanager
async def reactor(spin: float = 0.002, refusals_per_s: int = 0) -> AsyncIterator[Reactor]:
    """A started reactor, stopped afterwards."""
    r = Reactor(spin=spin, refusals_per_s=refusals_per_s)
    r.start()
    try:
        yield r
    finally:
        await asyncio.to_thread(r.stop)


async def tcp_pair(
    r: Reactor, queue_depth: int = 1, end: type[AgentEnd] | None = None
) -> tuple[HostEnd, AgentEnd]:
    """A connected tcp host link and agent link (the agent's on `r`, for a session of
    `queue_depth`; `end`: the agent end's class, `AgentEnd` or a subclass)."""
    host = tcp.TcpHostLink()
    host.listen()
    sock, token = await tcp.dial(host.address)
    agent = (end or AgentEnd)(tcp.TcpAgentLink(sock, token, queue_depth=queue_depth), r)
    await host.connect(agent.link.address)
    host_end = HostEnd(host)
    host_end.start()
    await agent.start()
    return host_end, agent


async def verbs_pair(
    r: Reactor,
    spin: float = 0.002,
    queue_depth: int = 32,
    host_where: dict[str, object] | None = None,
    inline_max: int = 0,
    **where: object,
) -> tuple[HostEnd, AgentEnd]:
    """A connected verbs host and agent link (`where`: the agent's device, port, gid_index;
    `host_where` the host's, else the same: two nodes or one device to itself; the agent
    takes inline sources of up to `inline_max` bytes)."""
    from dpu_wire.transport.verbs import VerbsAgentLink, VerbsHostLink  # noqa: PLC0415

    host_at = where if host_where is None else host_where
    host = VerbsHostLink(queue_depth=queue_depth, spin=max(spin, 0.0), **host_at)  # type: ignore[arg-type]
    agent_link = VerbsAgentLink(queue_depth=queue_depth, inline_max=inline_max, **where)  # type: ignore[arg-type]
    agent_link.connect(host.address)
    await host.connect(agent_link.address)
    host_end = HostEnd(host)
    host_end.start()
    agent = AgentEnd(agent_link, r)
    await agent.start()
    return host_end, agent

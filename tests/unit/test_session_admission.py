"""The session manager's admission bounds and reaper, over real tcp transports on loopback.

Per connection (`max_sessions_per_connection`), per tenant (`quota.max_sessions`),
per agent (`max_sessions`); a session nobody ever watched lives `first_watch_timeout`,
one whose watcher left lives `orphan_timeout`.
"""

import asyncio
import functools
import time

import pytest
import pytest_asyncio

from dpu_agent.dataplane import transports
from dpu_agent.dataplane.hostpolicy import parse_allow
from dpu_agent.dataplane.manager import TRANSPORT_TCP, ManagerSettings, SessionManager
from dpu_agent.dataplane.reactor import Reactor
from dpu_agent.errors import ResourceExhausted
from dpu_agent.quota import Quotas
from dpu_wire.transport.tcp import TcpHostLink

pytestmark = pytest.mark.asyncio


@pytest_asyncio.fixture
async def opened():
    hosts = []
    managers = []
    reactor = Reactor()
    reactor.start()
    # the "connections" below are names, not addresses: let the data plane dial loopback
    tcp = functools.partial(transports._tcp, parse_allow("127.0.0.0/8"), 30.0, 4096)

    def make(**settings):
        quotas = Quotas(max_sessions=settings.pop("tenant", 0))
        manager = SessionManager(
            ManagerSettings(chunk_size=4096, **settings),
            {TRANSPORT_TCP: tcp},
            reactor=reactor,
            quotas=quotas,
        )
        manager.start()
        managers.append(manager)

        async def open_one(tenant="t", connection="c1", request_id=""):
            host = TcpHostLink()
            host.listen()
            hosts.append(host)
            session = await manager.open(
                tenant=tenant,
                transport=0,
                queue_depth=1,
                label="",
                host=host.address,
                request_id=request_id,
                peer=connection,
            )
            await host.connect(session.address)
            return session

        return manager, open_one

    yield make
    for manager in managers:
        await manager.stop()
    for host in hosts:
        await host.close()
    await asyncio.to_thread(reactor.stop)


async def test_each_bound_refuses_with_its_own_name(opened):
    manager, open_one = opened(max_sessions=5, max_sessions_per_connection=2, tenant=3)
    await open_one(connection="c1")
    await open_one(connection="c1")
    with pytest.raises(ResourceExhausted, match="max_sessions_per_connection = 2"):
        await open_one(connection="c1")
    await open_one(connection="c2")  # the same tenant, another connection
    with pytest.raises(ResourceExhausted, match=r"quota\.max_sessions"):
        await open_one(connection="c3")
    await open_one(tenant="u", connection="c3")
    await open_one(tenant="u", connection="c4")
    with pytest.raises(ResourceExhausted, match="at most 5 sessions"):
        await open_one(tenant="v", connection="c5")
    first = manager.sessions()[0]
    await manager.close(first.name)  # a closed session gives its connection's slot back
    await open_one(connection="c1")


async def test_a_session_never_watched_goes_first_one_whose_watcher_left_later(opened):
    manager, open_one = opened(first_watch_timeout=0.3, orphan_timeout=1.5)
    never = await open_one(connection="c1")
    left = await open_one(connection="c2")
    watcher = left.watch(include_retained=False)
    left.unwatch(watcher)
    unwatched = time.monotonic()
    stays = await open_one(connection="c3")
    stays.watch(include_retained=False)
    async with asyncio.timeout(5):
        while never in manager.sessions():  # noqa: ASYNC110 - the reaper's own state
            await asyncio.sleep(0.02)
    assert left in manager.sessions()
    assert time.monotonic() - unwatched < 1.5  # the orphan clock has not run out yet
    async with asyncio.timeout(5):
        while left in manager.sessions():  # noqa: ASYNC110
            await asyncio.sleep(0.02)
    assert time.monotonic() - unwatched >= 1.5
    assert manager.sessions() == [stays]


async def test_a_replayed_open_finds_its_session_as_long_as_the_session_lives(opened):
    """DP-1.1-4: the (tenant, request_id) record lives as long as its session, so other
    tenants' opens cannot push it out (a shared list of 4,096 could be flushed), and it
    goes with the session (the record stays bounded by the sessions)."""
    manager, open_one = opened(max_sessions=8, max_sessions_per_connection=8)
    first = await open_one(tenant="a", request_id="open-1")
    for i in range(5):  # another tenant opens and closes sessions meanwhile
        other = await open_one(tenant="b", connection=f"c{i}", request_id=f"b-{i}")
        await manager.close(other.name)
    again = await manager.open(
        tenant="a", transport=0, queue_depth=1, label="", host=None, request_id="open-1"
    )
    assert again is first
    await manager.close(first.name)
    assert manager._by_request == {}

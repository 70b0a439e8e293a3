"""The tcp transport on loopback: the same semantics the verbs transport has."""

import asyncio
import os

import pytest
import pytest_asyncio

from dpu_wire.transport.base import Access, RemoteAccessError, TransportError
from dpu_wire.transport.tcp import TcpAgentTransport, TcpHostTransport

pytestmark = pytest.mark.asyncio


@pytest_asyncio.fixture
async def pair():
    host = TcpHostTransport()
    agent = TcpAgentTransport()
    await asyncio.gather(agent.connect(host.address), host.connect(agent.address))
    yield host, agent
    await agent.close()
    await host.close()


async def test_read_and_write_move_every_byte(pair):
    host, agent = pair
    size = 4 << 20
    src = host.register(size, Access.REMOTE_READ)
    dst = host.register(size, Access.REMOTE_WRITE)
    data = os.urandom(size)
    src.view[:] = data
    staging = agent.staging(size)
    await agent.read(staging, 0, size, src.addr, src.rkey)
    assert bytes(staging.view) == data
    await agent.write(staging, 0, size, dst.addr, dst.rkey)
    assert bytes(dst.view) == data
    agent.release(staging)


async def test_partial_spans_land_at_the_right_offsets(pair):
    host, agent = pair
    region = host.register(4096, Access.REMOTE_READ | Access.REMOTE_WRITE)
    region.view[:] = bytes(range(256)) * 16
    staging = agent.staging(100)
    await agent.read(staging, 10, 50, region.addr + 1000, region.rkey)
    assert bytes(staging.view[10:60]) == bytes(region.view[1000:1050])
    await agent.write(staging, 10, 50, region.addr + 3000, region.rkey)
    assert bytes(region.view[3000:3050]) == bytes(region.view[1000:1050])


@pytest.mark.parametrize(
    ("access", "op", "offset", "length", "key_delta"),
    [
        (Access.REMOTE_WRITE, "read", 0, 16, 0),  # not readable
        (Access.REMOTE_READ, "write", 0, 16, 0),  # not writable
        (Access.REMOTE_READ, "read", 4090, 16, 0),  # past the end
        (Access.REMOTE_READ, "read", -16, 16, 0),  # before the start
        (Access.REMOTE_READ, "read", 0, 16, 1),  # wrong rkey
    ],
)
async def test_refused_access_fails_the_op_not_the_link(
    pair, access, op, offset, length, key_delta
):
    host, agent = pair
    region = host.register(4096, access)
    staging = agent.staging(64)
    with pytest.raises(RemoteAccessError):
        await getattr(agent, op)(staging, 0, length, region.addr + offset, region.rkey + key_delta)
    ok = host.register(64, Access.REMOTE_READ)
    await agent.read(staging, 0, 64, ok.addr, ok.rkey)  # the link still works


async def test_capsules_both_ways_in_order(pair):
    host, agent = pair
    for i in range(50):
        await host.send(b"h%d" % i)
    for i in range(50):
        await agent.send(b"a%d" % i)
    assert [await agent.recv() for _ in range(50)] == [b"h%d" % i for i in range(50)]
    assert [await host.recv() for _ in range(50)] == [b"a%d" % i for i in range(50)]


async def test_write_is_visible_before_a_later_capsule(pair):
    host, agent = pair
    region = host.register(1 << 20, Access.REMOTE_WRITE)
    staging = agent.staging(1 << 20)
    staging.view[:] = b"\x5a" * (1 << 20)
    await agent.write(staging, 0, 1 << 20, region.addr, region.rkey)
    await agent.send(b"done")
    assert await host.recv() == b"done"
    assert bytes(region.view) == b"\x5a" * (1 << 20)


async def test_peer_gone_fails_pending_and_later_ops(pair):
    host, agent = pair
    region = host.register(64, Access.REMOTE_READ)
    await host.close()
    staging = agent.staging(64)
    with pytest.raises(TransportError):
        await agent.recv()
    with pytest.raises(TransportError):
        await agent.read(staging, 0, 64, region.addr, region.rkey)


async def test_deregistered_region_is_refused(pair):
    host, agent = pair
    region = host.register(64, Access.REMOTE_READ)
    addr, rkey = region.addr, region.rkey
    host.deregister(region)
    with pytest.raises(RemoteAccessError):
        await agent.read(agent.staging(64), 0, 64, addr, rkey)


async def test_close_is_idempotent(pair):
    host, agent = pair
    await agent.close()
    await agent.close()
    await host.close()
    await host.close()

"""The verbs transport on rxe0: the semantics of tests/unit/test_tcp_transport.py over RC QPs.

Host and agent links live in one process on the same device (two rxe devices in one
namespace cannot reach each other); the agent's runs on a real data-plane reactor
thread, the host's on this event loop. Every test runs with the reactor polling
adaptively, busily and on events only. Where RDMA differs from tcp the test asserts
the verbs behaviour: a vanished peer is noticed by the next operation once the RC
retry budget is spent.
"""

import asyncio
import contextlib
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import pytest_asyncio

from dpu_wire.capsule import MAX_CAPSULE
from dpu_wire.transport.base import (
    Access,
    RemoteAccessError,
    TcpAddress,
    TransportError,
)
from dpu_wire.transport.verbs import VerbsAgentLink, find_port
from tests.links import reactor, verbs_pair

pytestmark = [pytest.mark.rdma, pytest.mark.asyncio]

QUEUE_DEPTH = 4  # small, so that tests put more capsules in flight than there are slots
RECV_DEPTH = 2 * QUEUE_DEPTH + 8
BOUND_S = 60.0  # no operation may take longer: fail, never hang


async def bounded(awaitable, seconds=BOUND_S):
    async with asyncio.timeout(seconds):
        return await awaitable


@pytest.fixture(params=[0.002, -1.0, 0.0], ids=["adaptive", "busy", "event"])
def spin(request):
    return request.param


@contextlib.asynccontextmanager
async def _linked(rdma_port, host_port, spin, inline_max=0):
    """The agent's link on rdma_port (on a reactor polling as `spin` says), the host's on
    host_port, connected."""
    async with reactor(spin) as r:
        host, agent = await verbs_pair(
            r,
            spin,
            QUEUE_DEPTH,
            host_where={
                "device": host_port.device,
                "port": host_port.port,
                "gid_index": host_port.gid_index,
            },
            inline_max=inline_max,
            device=rdma_port.device,
            port=rdma_port.port,
            gid_index=rdma_port.gid_index,
        )
        yield host, agent
        await agent.close()
        await host.close()


@pytest_asyncio.fixture
async def pair(rdma_port, host_port, spin):
    async with _linked(rdma_port, host_port, spin) as linked:
        yield linked


def assert_same_bytes(got, want):
    """Compare every byte; on a mismatch say where, not a megabyte diff."""
    got, want = bytes(got), bytes(want)
    assert len(got) == len(want)
    if got != want:
        first = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
        pytest.fail(f"bytes differ from offset {first} of {len(want)}")


async def assert_link_dead(host, agent):
    """Both QPs are in the error state: the responder's too, its RECVs are flushed."""
    ok = host.link.register(64, Access.REMOTE_READ)
    staging = agent.staging(64)
    with pytest.raises(TransportError):
        await bounded(agent.read(staging, 0, 64, ok.addr, ok.rkey))
    with pytest.raises(TransportError):
        await bounded(agent.send(b"after"))
    with pytest.raises(TransportError):
        await bounded(agent.recv())
    with pytest.raises(TransportError, match="error state"):
        await bounded(host.recv())
    with pytest.raises(TransportError):
        host.send(b"after")


async def test_address_describes_the_queue_pair(pair):
    host, agent = pair
    for side in (host, agent):
        address = side.link.address
        assert len(address.gid) == 16
        assert address.gid[:12] == bytes(10) + b"\xff\xff"  # IPv4-mapped RoCEv2 GID
        assert 0 <= address.psn < 1 << 24
        assert address.mtu in (256, 512, 1024, 2048, 4096)
    # two queue pairs: on two nodes (the VM) the GIDs differ, on one device the QP numbers
    here, there = host.link.address, agent.link.address
    assert (here.gid, here.qp_num) != (there.gid, there.qp_num)


async def test_read_and_write_move_every_byte(pair):
    host, agent = pair
    size = 4 << 20
    src = host.link.register(size, Access.REMOTE_READ)
    dst = host.link.register(size, Access.REMOTE_WRITE)
    data = os.urandom(size)
    src.view[:] = data
    staging = agent.staging(size)
    await bounded(agent.read(staging, 0, size, src.addr, src.rkey))
    assert_same_bytes(staging.view, data)
    await bounded(agent.write(staging, 0, size, dst.addr, dst.rkey))
    assert_same_bytes(dst.view, data)


async def test_partial_spans_land_at_the_right_offsets(pair):
    host, agent = pair
    region = host.link.register(4096, Access.REMOTE_READ | Access.REMOTE_WRITE)
    region.view[:] = bytes(range(256)) * 16
    staging = agent.staging(100)
    await bounded(agent.read(staging, 10, 50, region.addr + 1000, region.rkey))
    assert bytes(staging.view[10:60]) == bytes(region.view[1000:1050])
    await bounded(agent.write(staging, 10, 50, region.addr + 3000, region.rkey))
    assert bytes(region.view[3000:3050]) == bytes(region.view[1000:1050])


async def test_capsules_both_ways_in_order(pair):
    host, agent = pair
    count = 3 * RECV_DEPTH  # every RECV buffer is consumed and reposted several times

    async def send_all(prefix):
        for i in range(count):
            await agent.send(b"%s%d" % (prefix, i))

    for i in range(count):
        host.send(b"h%d" % i)
    await bounded(send_all(b"a"))
    assert [await bounded(agent.recv()) for _ in range(count)] == [b"h%d" % i for i in range(count)]
    assert [await bounded(host.recv()) for _ in range(count)] == [b"a%d" % i for i in range(count)]


async def test_more_capsules_in_flight_than_slots_all_arrive(pair):
    host, agent = pair
    count = 6 * RECV_DEPTH
    sent = [os.urandom(1 + i % MAX_CAPSULE) for i in range(count)]
    for c in sent:
        host.send(c)
    await bounded(asyncio.gather(*(agent.send(c) for c in sent)))
    got_agent = [await bounded(agent.recv()) for _ in range(count)]
    got_host = [await bounded(host.recv()) for _ in range(count)]
    assert sorted(got_agent) == sorted(sent)
    assert sorted(got_host) == sorted(sent)


async def test_capsule_sizes_up_to_max(pair):
    host, agent = pair
    for size in (0, 1, MAX_CAPSULE - 1, MAX_CAPSULE):
        capsule = os.urandom(size)
        host.send(capsule)
        assert await bounded(agent.recv()) == capsule


async def test_write_is_visible_before_a_later_capsule(pair):
    host, agent = pair
    region = host.link.register(1 << 20, Access.REMOTE_WRITE)
    staging = agent.staging(1 << 20)
    staging.view[:] = b"\x5a" * (1 << 20)

    def post() -> None:  # the WRITE unsignalled and the SEND behind it, as a job's end
        agent.link.post_write(staging, 0, 1 << 20, region.addr, region.rkey, None)
        agent.link.post_send(b"done", None)
        agent.reactor.wake(agent.link)

    agent.reactor.call(post)
    assert await bounded(host.recv()) == b"done"
    assert bytes(region.view) == b"\x5a" * (1 << 20)


async def test_an_unsignalled_write_with_no_send_behind_it_goes_at_the_end_of_the_pass(pair):
    host, agent = pair
    size = 1 << 16
    region = host.link.register(size, Access.REMOTE_WRITE)
    staging = agent.staging(size)
    staging.view[:] = os.urandom(size)

    def post() -> None:  # held back for a SEND that never comes: the pass's flush posts it
        agent.link.post_write(staging, 0, size, region.addr, region.rkey, None)
        agent.reactor.wake(agent.link)

    agent.reactor.call(post)

    async def landed() -> None:
        while bytes(region.view[size - 16 :]) != bytes(staging.view[size - 16 :]):  # noqa: ASYNC110 - the NIC writes this memory: nothing to wait on
            await asyncio.sleep(0.01)

    await bounded(landed(), 20)
    assert_same_bytes(region.view, staging.view)


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
async def test_refused_access_fails_the_op_then_the_link_is_dead(
    pair, access, op, offset, length, key_delta
):
    host, agent = pair
    region = host.link.register(4096, access)
    staging = agent.staging(64)
    with pytest.raises(RemoteAccessError):
        await bounded(
            getattr(agent, op)(staging, 0, length, region.addr + offset, region.rkey + key_delta)
        )
    await assert_link_dead(host, agent)


async def test_deregistered_region_is_refused(pair):
    host, agent = pair
    region = host.link.register(64, Access.REMOTE_READ)
    addr, rkey = region.addr, region.rkey
    host.link.deregister(region)
    with pytest.raises(RemoteAccessError):
        await bounded(agent.read(agent.staging(64), 0, 64, addr, rkey))
    await assert_link_dead(host, agent)


async def test_a_refused_access_fails_every_pending_op(pair):
    host, agent = pair
    # 15 x 64 KiB ahead of the refused READ: enough to have operations pending when the
    # NAK arrives. 15 x 1 MiB in flight once outlasted the RC retry budget (then 7 x 67 ms)
    # under TCG in CI, so the requester saw IBV_WC_RETRY_EXC_ERR before the NAK.
    size = 64 << 10
    src = host.link.register(size, Access.REMOTE_READ)
    staging = agent.staging(16 * size)
    good = [agent.read(staging, i * size, size, src.addr, src.rkey) for i in range(15)]
    bad = agent.read(staging, 15 * size, 16, src.addr, src.rkey + 1)
    results = await bounded(asyncio.gather(*good, bad, return_exceptions=True))
    assert isinstance(results[-1], RemoteAccessError)
    for result in results[:-1]:  # completed before the error, or failed with the link
        assert result is None or isinstance(result, TransportError)
    await assert_link_dead(host, agent)


async def test_local_misuse_raises_value_error_and_keeps_the_link(pair):
    host, agent = pair
    region = host.link.register(4096, Access.REMOTE_READ)
    staging = agent.staging(64)
    with pytest.raises(ValueError, match="exceeds"):
        await agent.send(bytes(MAX_CAPSULE + 1))
    with pytest.raises(ValueError, match="outside"):
        await agent.read(staging, 32, 64, region.addr, region.rkey)
    with pytest.raises(ValueError, match="not a live staging region"):
        await agent.read(host.link.register(64, Access.NONE), 0, 64, region.addr, region.rkey)
    with pytest.raises(ValueError, match="exceeds"):
        host.send(bytes(MAX_CAPSULE + 1))
    await bounded(agent.read(staging, 0, 64, region.addr, region.rkey))  # still fine


@pytest.mark.parametrize("gone", ["host", "agent"])
async def test_peer_gone_fails_the_survivor(pair, gone):
    host, agent = pair
    region = host.link.register(64, Access.REMOTE_READ)
    staging = agent.staging(64)
    started = time.monotonic()
    if gone == "host":
        await host.close()
        with pytest.raises(TransportError, match="RETRY_EXC"):
            await bounded(agent.read(staging, 0, 64, region.addr, region.rkey))
        survivor = agent
    else:
        await agent.close()
        host.send(b"anyone?")
        with pytest.raises(TransportError, match="RETRY_EXC"):
            await bounded(host.recv())
        survivor = host
    assert time.monotonic() - started < 15  # 7 tries x 268 ms, slowed down by emulation
    with pytest.raises(TransportError):
        await bounded(survivor.recv())


async def test_close_fails_later_calls(pair):
    _, agent = pair
    await agent.close()
    with pytest.raises(TransportError):
        await agent.send(b"x")
    with pytest.raises(TransportError):
        agent.staging(64)


async def test_close_is_idempotent(pair):
    host, agent = pair
    await agent.close()
    agent.link.close()
    await host.close()
    await host.close()


async def test_find_port_picks_the_ipv4_mapped_roce_v2_gid(rdma_port):
    expected = (rdma_port.device, rdma_port.port, rdma_port.gid_index)
    assert find_port(rdma_port.device) == expected
    assert find_port(rdma_port.device, rdma_port.port) == expected
    with pytest.raises(TransportError, match="no RDMA device named"):
        find_port("no-such-device")
    with pytest.raises(TransportError, match="no RDMA device named"):
        VerbsAgentLink(device="no-such-device")


async def test_connect_needs_a_verbs_address(rdma_port):
    agent = VerbsAgentLink(rdma_port.device, rdma_port.port, rdma_port.gid_index)
    with pytest.raises(TransportError, match="verbs address"):
        agent.connect(TcpAddress("127.0.0.1", 1))
    agent.close()


async def test_64_concurrent_reads_and_writes_move_every_byte(pair):
    host, agent = pair
    rng = random.Random(20261)  # noqa: S311 - sizes, not secrets
    sizes = [rng.randint(4 << 10, 1 << 20) for _ in range(64)]
    offsets = [sum(sizes[:i]) for i in range(64)]
    total = sum(sizes)
    src = host.link.register(total, Access.REMOTE_READ)
    dst = host.link.register(total, Access.REMOTE_WRITE)
    staging = agent.staging(total)
    data = os.urandom(total)
    src.view[:] = data

    limit = asyncio.Semaphore(2 * QUEUE_DEPTH)  # what the send queue holds

    async def move(offset, size):
        async with limit:
            await _move(offset, size)

    async def _move(offset, size):
        await agent.read(staging, offset, size, src.addr + offset, src.rkey)
        assert_same_bytes(staging.view[offset : offset + size], data[offset : offset + size])
        await agent.write(staging, offset, size, dst.addr + offset, dst.rkey)

    await bounded(asyncio.gather(*(move(o, s) for o, s in zip(offsets, sizes, strict=True))))
    assert_same_bytes(dst.view, data)


def _hw_counter(where, name):
    """A counter of rxe's on `where`'s port (`/sys/class/infiniband/.../hw_counters`)."""
    path = Path("/sys/class/infiniband") / where.device / "ports" / str(where.port)
    return int((path / "hw_counters" / name).read_text())


async def test_a_stream_of_large_writes_reaches_the_responder_in_order(rdma_port, host_port):
    """The test bed keeps each QP's packets in order (RPS on the veth pair).

    Without it, a stream of 1 MiB WRITEs made the responder see packets out of order in
    most runs. Each gap costs the requester a retry (a sequence NAK), and enough of them
    fail a live session with IBV_WC_RETRY_EXC_ERR.
    """
    size, count = 1 << 20, 64
    async with _linked(rdma_port, host_port, 0.002) as (host, agent):
        dst = host.link.register(count * size, Access.REMOTE_WRITE)
        staging = agent.staging(count * size)
        staging.view[:] = os.urandom(count * size)
        gaps = _hw_counter(host_port, "out_of_seq_request")
        naks = _hw_counter(rdma_port, "rcvd_seq_err")
        limit = asyncio.Semaphore(2 * QUEUE_DEPTH)  # what the send queue holds

        async def write(at):
            async with limit:
                await agent.write(staging, at, size, dst.addr + at, dst.rkey)

        await bounded(asyncio.gather(*(write(i * size) for i in range(count))))
        assert_same_bytes(dst.view, staging.view)
        assert _hw_counter(host_port, "out_of_seq_request") - gaps == 0
        assert _hw_counter(rdma_port, "rcvd_seq_err") - naks == 0


LEFT_OPEN = """
import asyncio, sys
from dpu_wire.transport.base import Access
from dpu_wire.transport.verbs import VerbsAgentLink, VerbsHostLink

async def main():
    host = VerbsHostLink(device=sys.argv[2], queue_depth=4)
    agent = VerbsAgentLink(device=sys.argv[1], queue_depth=4)
    agent.connect(host.address)
    await host.connect(agent.address)
    host.start(lambda capsule: None, lambda error: None, lambda: False)
    host.register(4096, Access.REMOTE_READ)
    agent.staging(4096)
    host.send([b"left open"])
    await asyncio.sleep(0.2)
    print("exiting with the links open", flush=True)

asyncio.run(main())
"""


async def test_links_left_open_are_closed_cleanly_at_exit(rdma_port, host_port):
    """A program that forgets to close its links still exits cleanly (no pyverbs teardown crash)."""
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", LEFT_OPEN, rdma_port.device, host_port.device],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.stdout.strip() == "exiting with the links open", done.stderr
    assert done.returncode == 0, done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr


INLINE_MAX = 4096


@pytest_asyncio.fixture
async def inline_pair(rdma_port, host_port):
    """A pair whose agent link takes INLINE SUBMITs of up to INLINE_MAX source bytes."""
    async with _linked(rdma_port, host_port, 0.002, INLINE_MAX) as linked:
        yield linked


async def test_inline_sources_arrive_whole_once_the_host_accepts_them(inline_pair):
    host, agent = inline_pair
    assert agent.link.inline_max == INLINE_MAX
    src = host.link.register(INLINE_MAX, Access.REMOTE_READ)
    src.view[:] = os.urandom(INLINE_MAX)
    span = (src.addr, INLINE_MAX, src.rkey)
    head = os.urandom(80)  # the SUBMIT's bytes, as far as the transport cares
    assert host.link.local_view(span) is None, "inline before accept_inline"
    with pytest.raises(TypeError, match="no inline sources"):
        host.link.send([(head, src.view)])
    assert host.link.accept_inline(INLINE_MAX) == INLINE_MAX
    view = host.link.local_view(span)
    assert view is not None
    assert bytes(view) == bytes(src.view)
    assert host.link.local_view((src.addr + 1, INLINE_MAX, src.rkey)) is None  # past the end
    assert host.link.local_view((src.addr, 16, src.rkey + 1)) is None  # no such region
    written = host.link.register(64, Access.REMOTE_WRITE)
    assert host.link.local_view((written.addr, 16, written.rkey)) is None  # not READ-able
    sizes = (1, 176, 177, INLINE_MAX) * (RECV_DEPTH // 2)  # more SENDs than send slots
    host.link.send([(head, view[:n]) for n in sizes])
    for n in sizes:
        assert await bounded(agent.recv()) == head + bytes(view[:n])
    with pytest.raises(ValueError, match="exceeds"):
        host.send(os.urandom(80 + INLINE_MAX + 1))
    with pytest.raises(ValueError, match="exceeds"):
        host.link.send([(head + b"x", view)])
    host.send(b"still up")
    assert await bounded(agent.recv()) == b"still up"


async def test_send_slots_grow_only_while_no_send_is_in_flight(inline_pair):
    host, agent = inline_pair
    host.send(b"first")  # posted now, its completion polled on a later loop iteration
    with pytest.raises(TransportError, match="in flight"):
        host.link.accept_inline(INLINE_MAX)
    assert await bounded(agent.recv()) == b"first"


async def test_the_hosts_spin_stops_while_answers_come_further_apart_than_it(rdma_port, host_port):
    # The host's link spins for an answer only while answers have come, on average,
    # within `spin` of the send before them: spinning for answers that are not near
    # only takes the CPU from the work being waited for. Counted by the core's spins
    # (each runs out here: nothing more is due), never by time.
    spin = 0.2
    async with _linked(rdma_port, host_port, spin) as (host, agent):
        link = host.link
        spins = []
        spin_recv = link._qp.spin_recv

        def counted(sink, timeout):
            spins.append(spin_recv(sink, timeout))
            return spins[-1]

        link._qp.spin_recv = counted
        host.expecting = True

        async def spun_after(after):
            """Whether the host spins once an answer came `after` s (plus the way) late."""
            capsule = b"%d" % len(spins)
            host.send(capsule)
            assert await bounded(agent.recv()) == capsule
            await asyncio.sleep(after)
            await agent.send(capsule)
            assert await bounded(host.capsules.get()) == capsule
            before = len(spins)
            link.wait()
            return len(spins) > before

        assert await spun_after(0.0)
        late = [await spun_after(3 * spin) for _ in range(4)]  # the average's weight: 1/4
        assert not late[-1], "still spinning for answers 3 spins apart"
        assert late == sorted(late, reverse=True), late  # once it stopped, it stays stopped
        quick = [await spun_after(0.0) for _ in range(6)]
        assert quick[-1], "no spin once the answers came quickly again"
        assert quick == sorted(quick), quick
        assert not any(spins), "a capsule came that nobody sent"

"""Checks of section 1 of docs/data-plane.md: OpenSession, the connection, the lease,
regions, volumes, keys, CloseSession."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import socket
import time
from typing import Any

import grpc

from dpu_wire.v1 import job_pb2, session_pb2
from tests.conformance import wire
from tests.conformance.harness import PROMPT, TIMERS, WAIT, Ctx, Sess, code_of, error_of, rid
from tests.conformance.rawtcp import READ, WRITE, RawTcpHost
from tests.conformance.shutdown import shutdown_scenario

INVALID = grpc.StatusCode.INVALID_ARGUMENT
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
VERBS_OK = {
    "gid": bytes(10) + b"\xff\xff" + bytes([10, 0, 0, 1]),
    "qp_num": 17,
    "psn": 5,
    "mtu": 1024,
}
TCP_OK = {"host": "127.0.0.1", "port": 9, "token": bytes(32)}


def verbs_endpoint(**fields: object) -> session_pb2.Endpoint:
    return session_pb2.Endpoint(verbs=session_pb2.VerbsEndpoint(**{**VERBS_OK, **fields}))  # type: ignore[arg-type]


def tcp_endpoint(**fields: object) -> session_pb2.Endpoint:
    return session_pb2.Endpoint(tcp=session_pb2.TcpEndpoint(**{**TCP_OK, **fields}))  # type: ignore[arg-type]


def own_endpoint(ctx: Ctx, **fields: object) -> session_pb2.Endpoint:
    return tcp_endpoint(**fields) if ctx.tcp else verbs_endpoint(**fields)


async def open_code(ctx: Ctx, **fields: Any) -> grpc.StatusCode:
    stubs = ctx.stubs()
    host = ctx.host()
    request = ctx.request(host, **fields)
    return await code_of(stubs.sessions.OpenSession(request, timeout=30))


# ---------------------------------------------------------------- 1.1


async def label_is_checked(ctx: Ctx) -> None:
    """DP-1.1-1."""
    assert await open_code(ctx, client_label="x" * 129) == INVALID
    assert await open_code(ctx, client_label="app\nforged log line") == INVALID
    assert await open_code(ctx, client_label="bell\x07") == INVALID
    label = "é-" * 64  # 128 printable characters are fine
    session = await ctx.open(lease=False, client_label=label)
    assert session.reply.client_label == label


async def endpoint_fields_are_checked(ctx: Ctx) -> None:
    """DP-1.1-2: this transport's endpoint."""
    if ctx.tcp:
        bad = [
            tcp_endpoint(host=""),
            tcp_endpoint(port=0),
            tcp_endpoint(port=70000),
            tcp_endpoint(token=b""),
            tcp_endpoint(token=bytes(31)),
            tcp_endpoint(token=bytes(33)),
        ]
    else:
        bad = [
            verbs_endpoint(gid=bytes(15)),
            verbs_endpoint(gid=bytes(17)),
            verbs_endpoint(qp_num=0),
            verbs_endpoint(qp_num=1 << 24),
            verbs_endpoint(psn=1 << 24),
            verbs_endpoint(mtu=1000),
        ]
    for endpoint in bad:
        assert await open_code(ctx, host_endpoint=endpoint) == INVALID, endpoint


async def open_while_draining(ctx: Ctx) -> None:
    """DP-1.1-3: seen by the shutdown scenario."""
    seen = await shutdown_scenario(ctx)
    assert seen.open_session == grpc.StatusCode.UNAVAILABLE


async def open_is_idempotent(ctx: Ctx) -> None:
    """DP-1.1-4."""
    stubs = ctx.stubs()
    first = ctx.host()
    first.listen()
    request = ctx.request(first)
    reply = await stubs.sessions.OpenSession(request, timeout=30)
    if isinstance(first, RawTcpHost):
        await first.connected(reply.agent_endpoint.tcp.token)
    ctx.adopt(stubs, first, reply)
    second = ctx.host()
    second.listen()
    again = await stubs.sessions.OpenSession(
        ctx.request(second, request_id=request.request_id), timeout=30
    )
    assert again.name == reply.name
    if isinstance(first, RawTcpHost) and isinstance(second, RawTcpHost):
        await asyncio.sleep(0.3)
        assert (first.accepted, second.accepted) == (1, 0), "a second data plane was dialled"
    listed = await stubs.sessions.ListSessions(session_pb2.ListSessionsRequest(page_size=1000))
    assert [s.name for s in listed.sessions].count(reply.name) == 1
    if ctx.tcp:
        await _retry_while_the_first_connects(ctx)


async def _retry_while_the_first_connects(ctx: Ctx) -> None:
    """A retry that arrives while the first call's data plane is still being connected
    (its host is slow with its HELLO) waits for it and gets the same session."""
    stubs = ctx.stubs()
    slow = ctx.host()
    assert isinstance(slow, RawTcpHost)
    slow.listen(hello_delay=1.0)
    request = ctx.request(slow)
    first_call = asyncio.ensure_future(stubs.sessions.OpenSession(request, timeout=30))
    await asyncio.sleep(0.3)  # the agent has dialled and waits for the HELLO
    retry = await stubs.sessions.OpenSession(request, timeout=30)
    first = await first_call
    ctx.adopt(stubs, slow, first)
    await slow.connected(first.agent_endpoint.tcp.token)
    assert (retry.name, retry.agent_endpoint.tcp.token) == (
        first.name,
        first.agent_endpoint.tcp.token,
    )
    await asyncio.sleep(0.3)
    assert slow.accepted == 1, "the retry dialled a second data plane"


async def transport_not_offered(ctx: Ctx) -> None:
    """DP-1.1-5: the agent under test offers only the transport of the run."""
    if ctx.tcp:
        fields = {"transport": 1, "host_endpoint": verbs_endpoint()}
    else:
        fields = {"transport": 2, "host_endpoint": tcp_endpoint()}
    assert await open_code(ctx, **fields) == grpc.StatusCode.FAILED_PRECONDITION


async def endpoint_of_the_other_kind(ctx: Ctx) -> None:
    """DP-1.1-6."""
    if ctx.tcp:
        fields = {"transport": 2, "host_endpoint": verbs_endpoint()}
    else:
        fields = {"transport": 1, "host_endpoint": tcp_endpoint()}
    assert await open_code(ctx, **fields) == INVALID


async def endpoint_and_depth(ctx: Ctx) -> None:
    """DP-1.1-7."""
    assert await open_code(ctx, transport=0, host_endpoint=None) == INVALID
    assert await open_code(ctx, queue_depth=1025) == INVALID
    stubs = ctx.stubs()
    host = ctx.host(32)
    host.listen()
    reply = await stubs.sessions.OpenSession(ctx.request(host, queue_depth=0), timeout=30)
    session = ctx.adopt(stubs, host, reply)
    assert reply.queue_depth == 32, "queue_depth 0 must be the agent's default ([dataplane] 32)"
    await session.close()


async def limits(ctx: Ctx) -> None:
    """DP-1.1-8 (short profile: 2 sessions per connection, 3 per tenant)."""
    a = ctx.stubs("short")
    b = ctx.stubs("short")
    held = [await ctx.open("short", stubs=a) for _ in range(2)]
    over = ctx.host()
    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
    assert await code_of(a.sessions.OpenSession(ctx.request(over), timeout=30)) == exhausted
    held.append(await ctx.open("short", stubs=b))  # the tenant's third
    assert await code_of(b.sessions.OpenSession(ctx.request(ctx.host()), timeout=30)) == exhausted
    await held[0].close()  # a slot comes back
    held.append(await ctx.open("short", stubs=b))


async def failed_connect_leaves_nothing(ctx: Ctx) -> None:
    """DP-1.1-9: tcp, a closed port; verbs, a host address nobody answers ARP for."""
    stubs = ctx.stubs()
    listing = session_pb2.ListSessionsRequest(page_size=1000)
    before = {s.name for s in (await stubs.sessions.ListSessions(listing)).sessions}
    if ctx.tcp:
        endpoint = tcp_endpoint(port=_closed_port(), token=os.urandom(32))
    else:
        endpoint = verbs_endpoint(gid=silent_gids(ctx, 1)[0])
    error = await error_of(
        stubs.sessions.OpenSession(ctx.request(ctx.host(), host_endpoint=endpoint), timeout=30)
    )
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    after = {s.name for s in (await stubs.sessions.ListSessions(listing)).sessions}
    assert after <= before, after - before


async def the_answer(ctx: Ctx) -> None:
    """DP-1.1-10."""
    session = await ctx.open(queue_depth=5, lease=False)
    reply = session.reply
    assert re.fullmatch(r"sessions/s-[0-9a-f]{12}", reply.name), reply.name
    assert reply.state == session_pb2.SESSION_STATE_ACTIVE
    assert reply.queue_depth == 5
    assert reply.transport == (2 if ctx.tcp else 1)
    assert reply.agent_endpoint.WhichOneof("kind") == ctx.transport


# ---------------------------------------------------------------- 1.2


async def verbs_agent_endpoint(ctx: Ctx) -> None:
    """DP-1.2-1."""
    v = (await ctx.open(lease=False)).reply.agent_endpoint.verbs
    assert len(v.gid) == 16
    assert v.gid[:12] == bytes(10) + b"\xff\xff", f"not IPv4-mapped: {v.gid.hex()}"
    assert 0 < v.qp_num < 1 << 24
    assert v.psn < 1 << 24
    assert v.mtu in (256, 512, 1024, 2048, 4096)


async def rts_before_the_answer(ctx: Ctx) -> None:
    """DP-1.2-2: a SUBMIT sent the moment the host's QP is in RTS is served."""
    session = await ctx.open(lease=False)
    data = os.urandom(4096)
    src = await session.region(4096, READ, fill=data)
    done = await session.run(wire.Kind.CRC32C, src.span())
    assert done.ok, done


def mapped(ip: str) -> bytes:
    """The IPv4-mapped GID of an IPv4 address."""
    return ipaddress.IPv6Address(f"::ffff:{ip}").packed


NOT_UNICAST_GIDS = [
    bytes(16),  # ::
    ipaddress.IPv6Address("::1").packed,
    ipaddress.IPv6Address("ff02::1").packed,  # multicast: an audit saw it accepted
    ipaddress.IPv6Address("fe80::1").packed,  # link-local: reachable from RoCEv1 GIDs only
    ipaddress.IPv6Address("2001:db8::1").packed,  # IPv6: the agent's GID is IPv4-mapped
    bytes(10) + b"\xff\xff" + bytes(4),  # ::ffff:0.0.0.0
    mapped("0.1.2.3"),
    mapped("127.0.0.1"),
    mapped("224.0.0.1"),
    mapped("239.255.255.250"),
    mapped("240.0.0.1"),
    mapped("255.255.255.255"),
]


def silent_gids(ctx: Ctx, count: int) -> list[bytes]:
    """GIDs of addresses next to the host's that nobody holds, so no ARP answer comes.

    In the host's /24, from .254 down, leaving out the host's own (in the test VM only
    the agent's .1 and the host's .2 are held).
    """
    own = ipaddress.IPv6Address(ctx.host().endpoint().verbs.gid).ipv4_mapped
    assert own is not None
    prefix = own.packed[:3]
    last = [n for n in range(254, 200, -1) if n != own.packed[3]]
    return [mapped(str(ipaddress.IPv4Address(prefix + bytes([n])))) for n in last[:count]]


async def gid_must_be_unicast_ipv4(ctx: Ctx) -> None:
    """DP-1.2-3: a field check (section 1.1, step 2): a tcp-only agent answers it too,
    before it says it offers no verbs (FAILED_PRECONDITION, step 5)."""
    for gid in NOT_UNICAST_GIDS:
        code = await open_code(ctx, transport=1, host_endpoint=verbs_endpoint(gid=gid))
        assert code == INVALID, (ipaddress.IPv6Address(gid), code)
    if ctx.tcp:
        fine = await open_code(ctx, transport=1, host_endpoint=verbs_endpoint())
        assert fine == grpc.StatusCode.FAILED_PRECONDITION
    else:
        await ctx.open(lease=False)  # the host's own GID is fine


async def verbs_allow_is_honoured(ctx: Ctx) -> None:
    """DP-1.2-4, profile verbs_allow ("peer,198.51.100.0/24"; the caller is 127.0.0.1):
    the host's GID is in neither; an address in the network passes the policy and
    fails only to resolve (nobody holds it)."""
    stubs = ctx.stubs("verbs_allow")
    listing = session_pb2.ListSessionsRequest(page_size=1000)
    before = {s.name for s in (await stubs.sessions.ListSessions(listing)).sessions}
    host = ctx.host()
    host.listen()
    refused = await error_of(stubs.sessions.OpenSession(ctx.request(host), timeout=30))
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED, refused
    assert "verbs_allow" in (refused.details() or "")
    listed = verbs_endpoint(gid=mapped("198.51.100.7"))
    passed = await error_of(
        stubs.sessions.OpenSession(ctx.request(ctx.host(), host_endpoint=listed), timeout=30)
    )
    assert passed.code() == UNAVAILABLE, passed
    after = {s.name for s in (await stubs.sessions.ListSessions(listing)).sessions}
    assert after <= before, after - before


async def resolution_holds_up_nothing_else(ctx: Ctx) -> None:
    """DP-1.2-5: while OpenSessions naming hosts nobody answers ARP for are in flight
    (2 s each), another session's jobs complete and ListSessions answers, again and
    again. (Before, each such OpenSession stopped the whole agent for a second, one
    after the other: nothing was answered until the first of them was.)"""
    session = await ctx.open(lease=False)
    data = os.urandom(4096)
    src = await session.region(4096, READ, fill=data)
    stubs = ctx.stubs()
    listing = session_pb2.ListSessionsRequest(page_size=1000)
    opens = [  # 3: one resolution slot of 4 to spare
        asyncio.ensure_future(
            code_of(
                stubs.sessions.OpenSession(
                    ctx.request(ctx.host(), host_endpoint=verbs_endpoint(gid=gid)), timeout=30
                )
            )
        )
        for gid in silent_gids(ctx, 3)
    ]
    rounds = 0  # a job completed and ListSessions answered, all the opens still waiting
    try:
        while not any(task.done() for task in opens):
            done = await session.run(wire.Kind.CRC32C, src.span())
            assert done.ok, done
            await stubs.sessions.ListSessions(listing)
            rounds += not any(task.done() for task in opens)
    finally:
        codes = await asyncio.gather(*opens)
    assert set(codes) == {UNAVAILABLE}, codes
    assert rounds >= 3, f"{rounds} jobs and ListSessions done while the OpenSessions waited"


async def unresolved_reads_the_same(ctx: Ctx) -> None:
    """DP-1.2-6: on-link addresses nobody holds, an off-link one (TEST-NET-1), at once."""
    stubs = ctx.stubs()
    gids = [*silent_gids(ctx, 2), mapped("192.0.2.1")]
    errors = await asyncio.gather(
        *(
            error_of(
                stubs.sessions.OpenSession(
                    ctx.request(ctx.host(), host_endpoint=verbs_endpoint(gid=gid)), timeout=30
                )
            )
            for gid in gids
        )
    )
    assert {e.code() for e in errors} == {UNAVAILABLE}, errors
    assert len({e.details() for e in errors}) == 1, [e.details() for e in errors]


# ---------------------------------------------------------------- 1.3


async def dial_only_the_caller(ctx: Ctx) -> None:
    """DP-1.3-1: 127.0.0.2 is not the caller's address (127.0.0.1)."""
    other = RawTcpHost(bind="127.0.0.2")
    ctx._hosts.append(other)
    other.listen()
    stubs = ctx.stubs()
    request = ctx.request(other)
    assert await code_of(stubs.sessions.OpenSession(request, timeout=30)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    await asyncio.sleep(0.2)
    assert other.accepted == 0, "the agent connected to an address the caller is not at"


async def _refused_listener(ctx: Ctx, first: bytes) -> tuple[grpc.aio.AioRpcError, RawTcpHost]:
    host = ctx.host()
    assert isinstance(host, RawTcpHost)
    host.listen(hello=first)
    error = await error_of(ctx.stubs().sessions.OpenSession(ctx.request(host), timeout=30))
    await asyncio.wait_for(host.eof.wait(), 10)  # the agent closed the connection
    return error, host


async def nothing_before_the_hello(ctx: Ctx) -> None:
    """DP-1.3-2: wrong token, another frame first, a short HELLO, silence (3 s)."""
    firsts = [
        wire.hello(os.urandom(32)),
        wire.capsule_frame(wire.cancel(1)),
        wire.frame(wire.Ft.HELLO, length=31) + bytes(31),
        b"",
    ]
    started = time.monotonic()
    results = await asyncio.gather(*(_refused_listener(ctx, first) for first in firsts))
    for (error, host), first in zip(results, firsts, strict=True):
        assert error.code() == grpc.StatusCode.UNAVAILABLE, (first, error)
        assert host.accepted == 1
        assert host.agent_hello is None, f"the agent sent {host.agent_hello!r} after {first!r}"
    assert time.monotonic() - started < 10, "the agent waited far longer than 3 s for a HELLO"


async def every_failure_reads_the_same(ctx: Ctx) -> None:
    """DP-1.3-3: a closed port, a stranger's listener (silent: 3 s), a wrong token."""
    stubs = ctx.stubs()
    stranger = socket.create_server(("127.0.0.1", 0))

    async def dial(port: int) -> grpc.aio.AioRpcError:
        endpoint = tcp_endpoint(port=port, token=os.urandom(32))
        request = ctx.request(ctx.host(), host_endpoint=endpoint)
        return await error_of(stubs.sessions.OpenSession(request, timeout=30))

    async def wrong_token() -> grpc.aio.AioRpcError:
        return (await _refused_listener(ctx, wire.hello(os.urandom(32))))[0]

    try:
        answers = await asyncio.gather(
            dial(_closed_port()), dial(stranger.getsockname()[1]), wrong_token()
        )
    finally:
        stranger.close()
    assert {a.code() for a in answers} == {grpc.StatusCode.UNAVAILABLE}
    assert len({a.details() for a in answers}) == 1, [a.details() for a in answers]


async def agent_hello(ctx: Ctx) -> None:
    """DP-1.3-4 (`Ctx.open` checked the HELLO carries the answer's token)."""
    one = await ctx.open(lease=False)
    two = await ctx.open(lease=False)
    tokens = [s.reply.agent_endpoint.tcp.token for s in (one, two)]
    assert all(len(t) == 32 for t in tokens)
    assert tokens[0] != tokens[1], "the agent's tokens must be fresh per session"
    assert (await one.get()).agent_endpoint.tcp.token == b""
    listed = await one.stubs.sessions.ListSessions(session_pb2.ListSessionsRequest(page_size=1000))
    assert all(s.agent_endpoint.tcp.token == b"" for s in listed.sessions)


# ---------------------------------------------------------------- 1.4


async def lease_metadata(ctx: Ctx) -> None:
    """DP-1.4-1: the metadata comes though no completion ever does."""
    session = await ctx.open(lease=False)
    call = session.watch(job_pb2.JOB_ORIGIN_CAPSULE)
    await asyncio.wait_for(call.initial_metadata(), 5)
    assert not call.done()
    call.cancel()


async def never_watched(ctx: Ctx) -> None:
    """DP-1.4-3 (short profile: first_watch_timeout 1 s)."""
    session = await ctx.open("short", lease=False)
    opened = time.monotonic()
    job = await session.slow_write()
    await asyncio.sleep(TIMERS["first_watch"] * 0.6)
    assert (await session.get()).state == session_pb2.SESSION_STATE_ACTIVE, "closed too early"
    cancelled = await session.completion_for(job, timeout=WAIT)
    assert cancelled.state == wire.St.CANCELLED, cancelled
    gone = await _gone_after(session)
    assert TIMERS["first_watch"] - 0.1 <= gone - opened <= TIMERS["first_watch"] + PROMPT, (
        gone - opened
    )


async def orphaned(ctx: Ctx) -> None:
    """DP-1.4-4 (short profile: orphan_timeout 1 s)."""
    session = await ctx.open("short")
    await asyncio.sleep(TIMERS["orphan"] * 2.5)  # watched: it lives
    assert (await session.get()).state == session_pb2.SESSION_STATE_ACTIVE
    job = await session.slow_write()
    session.lease.cancel()
    left = time.monotonic()
    await asyncio.sleep(TIMERS["orphan"] * 0.6)
    assert (await session.get()).state == session_pb2.SESSION_STATE_ACTIVE, "closed too early"
    cancelled = await session.completion_for(job, timeout=WAIT)
    assert cancelled.state == wire.St.CANCELLED, cancelled
    gone = await _gone_after(session)
    assert gone - left <= TIMERS["orphan"] + PROMPT, gone - left


async def _gone_after(session: Sess) -> float:
    """When GetSession first answered NOT_FOUND (monotonic)."""
    for _ in range(500):
        code = await code_of(session.get())
        if code == grpc.StatusCode.NOT_FOUND:
            return time.monotonic()
        await asyncio.sleep(0.02)
    raise AssertionError("the session was never closed")


async def sixteen_streams(ctx: Ctx) -> None:
    """DP-1.4-5: the lease and 15 more; the 17th is refused."""
    session = await ctx.open()
    calls = [session.watch() for _ in range(15)]
    await asyncio.gather(*(asyncio.wait_for(c.initial_metadata(), 10) for c in calls))
    extra = session.watch()
    assert await asyncio.wait_for(extra.code(), 10) == grpc.StatusCode.RESOURCE_EXHAUSTED
    for call in calls:
        call.cancel()


async def _drain(call: Any) -> tuple[list[job_pb2.Completion], grpc.StatusCode]:
    """Every message of a watch stream until it ends, and how it ended."""
    found: list[job_pb2.Completion] = []
    try:
        async for message in call:
            found.append(message)  # noqa: PERF401 - what came before an error counts too
    except grpc.aio.AioRpcError as exc:
        return found, exc.code()
    return found, await call.code()


async def origin_filter(ctx: Ctx) -> None:
    """DP-1.4-6."""
    session = await ctx.open()
    src = await session.region(4096, READ, fill=os.urandom(4096))
    dst = await session.region(4096, WRITE)
    watchers = {
        o: session.watch(o) for o in (job_pb2.JOB_ORIGIN_RPC, job_pb2.JOB_ORIGIN_CAPSULE, 0)
    }
    await asyncio.gather(*(c.initial_metadata() for c in watchers.values()))
    capsule_job = await session.submit(wire.Kind.COPY, src.span(), dst.span())
    assert (await session.completion_for(capsule_job)).ok
    spec = job_pb2.JobSpec(
        copy=job_pb2.CopyJob(source=session.ref(src), destination=session.ref(dst))
    )
    rpc_job = int((await session.submit_rpc(spec)).job_id)
    await asyncio.sleep(0.3)
    late = session.watch(job_pb2.JOB_ORIGIN_CAPSULE, include_retained=True)
    await late.initial_metadata()  # it is watching before the session closes
    await session.close()
    seen = {o: await asyncio.wait_for(_drain(c), 10) for o, c in watchers.items()}
    assert [m.job_id for m in seen[job_pb2.JOB_ORIGIN_RPC][0]] == [rpc_job]
    assert [m.job_id for m in seen[job_pb2.JOB_ORIGIN_CAPSULE][0]] == [capsule_job]
    assert sorted(m.job_id for m in seen[0][0]) == sorted([capsule_job, rpc_job])
    assert [m.job_id for m in (await asyncio.wait_for(_drain(late), 10))[0]] == [capsule_job]


def _region_message(
    session: Sess, rid_: str, rkey: int, **fields: object
) -> session_pb2.MemoryRegion:
    values = {
        "name": f"{session.name}/regions/{rid_}",
        "addr": 0x1000_0000,
        "length": 4096,
        "rkey": rkey,
        "access": [session_pb2.REGION_ACCESS_REMOTE_READ],
    }
    values.update(fields)
    return session_pb2.MemoryRegion(**values)  # type: ignore[arg-type]


async def _advertise(session: Sess, *regions: session_pb2.MemoryRegion) -> grpc.StatusCode:
    return await code_of(
        session.stubs.sessions.AdvertiseRegions(
            session_pb2.AdvertiseRegionsRequest(
                session=session.name,
                regions=regions,
                request_id=rid(),
            )
        )
    )


async def regions_all_or_none(ctx: Ctx) -> None:
    """DP-1.4-7."""
    session = await ctx.open(lease=False)
    exists = grpc.StatusCode.ALREADY_EXISTS
    assert await _advertise(session, _region_message(session, "a", 1)) == grpc.StatusCode.OK
    new = _region_message(session, "b", 2)
    assert await _advertise(session, new, _region_message(session, "a", 3)) == exists  # id
    assert await _advertise(session, new, _region_message(session, "c", 1)) == exists  # rkey
    assert await _advertise(session, new, _region_message(session, "b", 4)) == exists  # twice
    assert await _advertise(session, new, _region_message(session, "d", 2)) == exists
    assert await _advertise(session, new) == grpc.StatusCode.OK, "a refused request added a region"
    assert (await session.get()).counters.regions == 2


async def regions_invalid(ctx: Ctx) -> None:
    """DP-1.4-8."""
    session = await ctx.open(lease=False)
    bad = [
        _region_message(session, "a", 1, access=[]),
        _region_message(session, "a", 1, length=0),
        _region_message(session, "a", 1, length=(2**32 - 1) * 1024 + 1),
        _region_message(session, "a", 1, addr=2**64 - 100, length=101),
        _region_message(session, "a", 1, name="sessions/s-000000000000/regions/a"),
        _region_message(session, "a", 1, name=f"{session.name}/regions/Not_A_Label"),
    ]
    for region in bad:
        assert await _advertise(session, region) == INVALID, region
    assert await _advertise(session, _region_message(session, "a", 1, addr=2**64 - 4096)) == (
        grpc.StatusCode.OK
    ), "a region that ends at 2^64 is valid"


async def regions_per_session(ctx: Ctx) -> None:
    """DP-1.4-9."""
    session = await ctx.open(lease=False)
    first = [_region_message(session, f"r{i}", i + 1) for i in range(1000)]
    assert await _advertise(session, *first) == grpc.StatusCode.OK
    more = [_region_message(session, f"s{i}", 5000 + i) for i in range(25)]
    assert await _advertise(session, *more) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (await session.get()).counters.regions == 1000
    assert await _advertise(session, *more[:24]) == grpc.StatusCode.OK
    assert await _advertise(session, more[24]) == grpc.StatusCode.RESOURCE_EXHAUSTED


async def withdraw_region(ctx: Ctx) -> None:
    """DP-1.4-10."""
    session = await ctx.open(lease=False)
    src = await session.region(4096, READ, fill=os.urandom(4096))
    assert (await session.run(wire.Kind.CRC32C, src.span())).ok
    name = session.names[src.rkey]
    await session.stubs.sessions.WithdrawRegion(
        session_pb2.WithdrawRegionRequest(name=name, request_id=rid())
    )
    failed = await session.run(wire.Kind.CRC32C, src.span())
    assert (failed.state, failed.status) == (wire.St.FAILED, 3), failed
    again = session.stubs.sessions.WithdrawRegion(
        session_pb2.WithdrawRegionRequest(name=name, request_id=rid())
    )
    assert await code_of(again) == grpc.StatusCode.NOT_FOUND


async def addresses_are_names(ctx: Ctx) -> None:
    """DP-1.4-11 (tcp: the host names its memory as it likes)."""
    session = await ctx.open(lease=False)
    host = session.host
    assert isinstance(host, RawTcpHost)
    data = os.urandom(8192)
    src = host.region(8192, READ, addr=0x10, rkey=0xFFFF_FFFF)
    src.view[:] = data
    dst = host.region(8192, WRITE, addr=2**64 - 8192, rkey=1)
    await session.advertise(src, dst)
    done = await session.run(wire.Kind.COPY, src.span(), dst.span())
    assert done.ok, done
    assert bytes(dst.data) == data


async def volume_handles(ctx: Ctx) -> None:
    """DP-1.4-12."""
    session = await ctx.open(lease=False)
    one, two = await ctx.volume(), await ctx.volume()
    handle = await session.attach(one)
    assert 1 <= handle < 2**32
    assert await session.attach(one) == handle
    other = await session.attach(two)
    assert 1 <= other < 2**32
    assert other != handle
    # DetachVolume: the handle stops working and is not reused (section 1.4's text)
    dst = await session.region(4096, WRITE)
    read = wire.Kind.VOLUME_READ
    assert (await session.run(read, wire.ZERO, dst.span(), handle=handle)).ok

    def detach() -> Any:
        request = session_pb2.DetachVolumeRequest(
            session=session.name, volume=one, request_id=rid()
        )
        return session.stubs.sessions.DetachVolume(request)

    await detach()
    done = await session.run(read, wire.ZERO, dst.span(), handle=handle)
    assert (done.state, done.status) == (wire.St.FAILED, 3), done
    assert await code_of(detach()) == grpc.StatusCode.NOT_FOUND
    again = await session.attach(one)
    assert again not in (handle, other)
    assert (await session.run(read, wire.ZERO, dst.span(), handle=again)).ok


async def key_handles(ctx: Ctx) -> None:
    """DP-1.4-13."""
    session = await ctx.open(lease=False)
    for size in (0, 15, 17, 31, 33, 64):
        assert await code_of(session.key(os.urandom(size))) == INVALID, size
    handles = [await session.key(os.urandom(size)) for size in (16, 24, 32)]
    assert all(1 <= h < 2**32 for h in handles)
    assert len(set(handles)) == 3


# ---------------------------------------------------------------- 1.5


async def close_cancels_and_answers(ctx: Ctx) -> None:
    """DP-1.5-1: a job between chunks, and (tcp) one whose READ is outstanding."""
    session = await ctx.open()
    jobs = [await session.slow_write()]
    if ctx.tcp:
        jobs.append((await session.held_copy())[0])
    await asyncio.sleep(0.2)
    await session.close()
    for job in jobs:
        done = await session.completion_for(job, timeout=WAIT)
        assert (done.state, done.status) == (wire.St.CANCELLED, 1), done
        assert done.message == "session closed", done
    if ctx.tcp:
        await asyncio.wait_for(session.host.eof.wait(), WAIT)


async def close_keeps_origins(ctx: Ctx) -> None:
    """DP-1.5-2."""
    session = await ctx.open()
    watchers = {
        o: session.watch(o) for o in (job_pb2.JOB_ORIGIN_RPC, job_pb2.JOB_ORIGIN_CAPSULE, 0)
    }
    await asyncio.gather(*(c.initial_metadata() for c in watchers.values()))
    capsule_job = await session.slow_write()
    rpc_job = await session.slow_rpc()
    await asyncio.sleep(0.2)
    await session.close()
    seen = {o: (await asyncio.wait_for(_drain(c), 10))[0] for o, c in watchers.items()}
    cancelled = job_pb2.JOB_STATE_CANCELLED
    assert [(m.job_id, m.state) for m in seen[job_pb2.JOB_ORIGIN_RPC]] == [(rpc_job, cancelled)]
    assert [(m.job_id, m.state) for m in seen[job_pb2.JOB_ORIGIN_CAPSULE]] == [
        (capsule_job, cancelled)
    ]
    assert sorted(m.job_id for m in seen[0]) == sorted([capsule_job, rpc_job])


async def close_ends_everything(ctx: Ctx) -> None:
    """DP-1.5-3."""
    session = await ctx.open()
    await session.region(4096)
    await session.close()
    assert await code_of(session.get()) == grpc.StatusCode.NOT_FOUND
    assert await asyncio.wait_for(session.lease.code(), 5) == grpc.StatusCode.OK
    if ctx.tcp:
        await asyncio.wait_for(session.host.eof.wait(), WAIT)


# ---------------------------------------------------------------- helpers


def _closed_port() -> int:
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    return int(port)

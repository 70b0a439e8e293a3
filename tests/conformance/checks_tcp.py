"""Checks of section 3 of docs/data-plane.md (and the tcp host rules of section 1.3):
the tcp transport's frames, against a real agent or (host rules) the SDK's link."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
import sys
import termios
import time
from typing import TYPE_CHECKING

from dpu_wire.transport import tcp as sdk_tcp
from dpu_wire.transport.base import Access, TcpAddress
from dpu_wire.v1 import job_pb2, session_pb2
from tests.conformance import wire
from tests.conformance.harness import CHUNK, PROMPT, TIMERS, WAIT, Ctx, Sess
from tests.conformance.rawtcp import READ, WRITE, RawTcpHost
from tests.conformance.wire import Frame, Ft, Kind, Span, St

if TYPE_CHECKING:
    from collections.abc import Callable

    from dpu_wire.transport.base import Region


def _host(session: Sess) -> RawTcpHost:
    assert isinstance(session.host, RawTcpHost)
    return session.host


async def _ended(session: Sess) -> None:
    """The agent closed the connection and failed the session."""
    await asyncio.wait_for(_host(session).eof.wait(), WAIT)
    state = await session.wait_state(session_pb2.SESSION_STATE_FAILED)
    assert state.state == session_pb2.SESSION_STATE_FAILED, state
    assert state.error.code == 14, state


# ---------------------------------------------------------------- the agent's frames


async def agent_frames(ctx: Ctx) -> None:
    """DP-3-1: every header the agent sent during jobs of several kinds."""
    session = await ctx.open(queue_depth=16)
    n = 3 * CHUNK + 5
    src = await session.region(n, READ, fill=os.urandom(n))
    dst = await session.region(2 * n, WRITE)
    jobs = [
        wire.submit(session.next_id(), Kind.COPY, src.span(), dst.span(0, n)),
        wire.submit(session.next_id(), Kind.CRC32C, src.span()),
        wire.submit(session.next_id(), Kind.SHA256, src.span(), dst.span(n, 64)),
        wire.submit(session.next_id(), Kind.COMPRESS, src.span(), dst.span(), handle=wire.ZSTD),
    ]
    await session.send(*jobs)
    for _ in jobs:
        assert (await session.completion()).ok
    frames = _host(session).frames
    requests = [f for f in frames if f.type in (Ft.READ, Ft.WRITE)]
    assert requests, frames
    assert {f.type for f in frames} <= {Ft.CAPSULE, Ft.READ, Ft.WRITE}, frames
    assert all(f.reserved == 0 and f.status == 0 for f in frames)
    assert all(f.req_id == f.addr == f.rkey == 0 for f in frames if f.type == Ft.CAPSULE)
    assert all(f.req_id != 0 and 1 <= f.length <= CHUNK for f in requests), requests
    assert len({f.req_id for f in requests}) == len(requests), "a req_id was reused"
    assert _host(session).violations == []


# ---------------------------------------------------------------- violations


async def _violation(ctx: Ctx, data: bytes) -> None:
    session = await ctx.open()
    await _host(session).send(data)
    await _ended(session)


async def host_violations(ctx: Ctx) -> None:
    """DP-3-2."""
    cases = [
        wire.frame(9),
        wire.frame(0),
        wire.hello(os.urandom(32)),
        wire.frame(Ft.READ, 0, 1, 0x1000, 1, 16),
        wire.frame(Ft.WRITE, 0, 1, 0x1000, 1, 4) + b"abcd",
    ]
    await asyncio.gather(*(_violation(ctx, data) for data in cases))


async def _answer(ctx: Ctx, answer: Callable[[Frame], bytes]) -> None:
    session = await ctx.open()
    job, read, dst = await session.held_copy()
    await _host(session).send(answer(read))
    await _ended(session)
    found = await session.job(job)
    assert (found.state, found.completion.status.code) == (job_pb2.JOB_STATE_FAILED, 14), found
    assert bytes(dst.view) == bytes(dst.length), "a wrong answer was taken as data"


async def answers_must_match(ctx: Ctx) -> None:
    """DP-3-3 (issue 14, item 7)."""
    cases = [
        lambda r: wire.frame(Ft.WRITE_ACK, 0, r.req_id),  # the wrong type
        lambda r: wire.frame(Ft.READ_RESP, 0, r.req_id + 1, length=r.length) + bytes(r.length),
        lambda r: wire.frame(Ft.READ_RESP, 0, r.req_id, length=r.length - 1) + bytes(r.length - 1),
        lambda r: wire.frame(Ft.READ_RESP, 0, r.req_id, length=r.length + 8) + bytes(r.length + 8),
        lambda r: wire.frame(Ft.READ_RESP, 0, 0, length=r.length) + bytes(r.length),
    ]
    await asyncio.gather(*(_answer(ctx, case) for case in cases))
    session = await ctx.open()  # an acknowledgement nobody asked for
    await _host(session).send(wire.frame(Ft.WRITE_ACK, 0, 77))
    await _ended(session)


async def answers_in_any_order(ctx: Ctx) -> None:
    """DP-3-4."""
    session = await ctx.open()
    host = _host(session)
    host.hold_reads = True
    pairs = []
    for _ in range(3):
        data = os.urandom(4096)
        src = await session.region(4096, READ, fill=data)
        dst = await session.region(4096, WRITE)
        pairs.append((await session.submit(Kind.COPY, src.span(), dst.span()), data, dst))
    reads = [await asyncio.wait_for(host.held.get(), WAIT) for _ in pairs]
    host.hold_reads = False
    for read in reversed(reads):
        await host.answer_read(read)
    for job, data, dst in pairs:
        assert (await session.completion_for(job)).ok
        assert bytes(dst.view) == data


# ---------------------------------------------------------------- the host's side (the SDK)


class RawAgent:
    """The agent's end of a tcp data plane, by hand, against the SDK's `TcpHostLink`."""

    def __init__(self, link: sdk_tcp.TcpHostLink) -> None:
        self.link = link
        self.sock: socket.socket | None = None
        self.token = os.urandom(32)

    async def connect(
        self, token: bytes | None = None, first: bytes | None = None
    ) -> socket.socket:
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", self.link.address.port))
        header = await self.recv(sock, wire.FRAME.size)
        hello = Frame(*wire.FRAME.unpack(header))
        assert (hello.type, hello.length) == (Ft.HELLO, 32), hello
        assert await self.recv(sock, 32) == self.link.address.token
        await loop.sock_sendall(
            sock, first if first is not None else wire.hello(token or self.token)
        )
        return sock

    @staticmethod
    async def recv(sock: socket.socket, n: int) -> bytes:
        loop = asyncio.get_running_loop()
        data = b""
        while len(data) < n:
            chunk = await asyncio.wait_for(loop.sock_recv(sock, n - len(data)), 5)
            if not chunk:
                raise EOFError
            data += chunk
        return data

    @staticmethod
    async def eof(sock: socket.socket) -> bool:
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.sock_recv(sock, 4096), 5) == b""
        except ConnectionResetError:
            return True


async def host_hello_before_the_answer(ctx: Ctx) -> None:  # noqa: ARG001 - an SDK check
    """DP-1.3-6 (the SDK): HELLO on every connection while no OpenSession answer came."""
    link = sdk_tcp.TcpHostLink()
    link.listen()
    agent = RawAgent(link)
    try:
        # `connect` (the SDK calls it with the OpenSession answer) is never called here:
        # each connection must get the host's HELLO all the same (RawAgent checks it)
        socks = [await agent.connect() for _ in range(3)]
        for sock in socks:
            sock.close()
    finally:
        await link.close()


async def host_keeps_the_right_connection(ctx: Ctx) -> None:  # noqa: ARG001 - an SDK check
    """DP-1.3-5 (the SDK)."""
    link = sdk_tcp.TcpHostLink()
    link.listen()
    agent = RawAgent(link)
    try:
        strangers = [
            await agent.connect(token=os.urandom(32)),
            await agent.connect(first=wire.capsule_frame(wire.cancel(1))),
        ]
        right = await agent.connect()
        await asyncio.wait_for(link.connect(TcpAddress("", 0, agent.token)), 10)
        for sock in strangers:
            assert await RawAgent.eof(sock), "the SDK kept a connection without the agent's token"
        got: list[bytes] = []
        link.start(lambda data: got.append(bytes(data)), lambda _: None, lambda: True)
        await asyncio.get_running_loop().sock_sendall(right, wire.capsule_frame(wire.cancel(5)))
        for _ in range(100):
            if got:
                break
            await asyncio.sleep(0.02)
        assert got == [wire.cancel(5)]
        for sock in [*strangers, right]:
            sock.close()
    finally:
        await link.close()


async def _host_refuses(
    request: Callable[[Region], bytes], region_access: Access, expect: int
) -> None:
    link = sdk_tcp.TcpHostLink()
    link.listen()
    agent = RawAgent(link)
    sock = None
    try:
        region = link.register(4096, region_access)
        region.view[:] = b"\x42" * 4096
        sock = await agent.connect()
        await asyncio.wait_for(link.connect(TcpAddress("", 0, agent.token)), 10)
        delivered: list[bytes] = []
        link.start(lambda data: delivered.append(bytes(data)), lambda _: None, lambda: True)
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(sock, request(region) + wire.capsule_frame(wire.cancel(9)))
        answer = Frame(*wire.FRAME.unpack(await RawAgent.recv(sock, wire.FRAME.size)))
        assert answer.status == expect, answer
        if expect:
            assert await RawAgent.eof(sock), "the host went on after refusing an access"
            await asyncio.sleep(0.1)
            assert delivered == [], "the host delivered a frame that followed its refusal"
            return
        if answer.type == Ft.READ_RESP:
            assert await RawAgent.recv(sock, answer.length) == bytes(region.view[: answer.length])
        else:
            assert bytes(region.view[:16]) == b"\x01" * 16
        for _ in range(100):
            if delivered:
                break
            await asyncio.sleep(0.02)
        assert delivered == [wire.cancel(9)]
    finally:
        if sock is not None:
            sock.close()
        await link.close()


def _read(length: int = 16, offset: int = 0, rkey: int | None = None) -> Callable[[Region], bytes]:
    return lambda r: wire.frame(
        Ft.READ, 0, 1, r.addr + offset, r.rkey if rkey is None else rkey, length
    )


def _write(length: int = 16, offset: int = 0) -> Callable[[Region], bytes]:
    return lambda r: wire.frame(Ft.WRITE, 0, 1, r.addr + offset, r.rkey, length) + b"\x01" * length


async def host_checks_like_a_nic(ctx: Ctx) -> None:  # noqa: ARG001 - an SDK check
    """DP-3-5 (the SDK): served in bounds; refused otherwise, and then nothing more."""
    cases = [
        (_read(), Access.REMOTE_READ, 0),
        (_write(), Access.REMOTE_WRITE, 0),
        (_read(), Access.REMOTE_WRITE, 1),  # no REMOTE_READ
        (_write(), Access.REMOTE_READ, 1),  # no REMOTE_WRITE
        (_read(rkey=0), Access.REMOTE_READ, 1),  # not its rkey
        (_read(length=4097), Access.REMOTE_READ, 1),  # past the end
        (_read(length=16, offset=4090), Access.REMOTE_READ, 1),
        (_write(length=4097), Access.REMOTE_WRITE, 1),
        (_read(offset=-1), Access.REMOTE_READ, 1),  # before the start
    ]
    for request, access, expect in cases:
        await _host_refuses(request, access, expect)


# ---------------------------------------------------------------- refusals, timeouts, EOF


async def refusal_ends_the_data_plane(ctx: Ctx) -> None:
    """DP-3-6 (issue 14, item 9): a refused READ, then a refused WRITE."""
    for refused_kind in (Ft.READ, Ft.WRITE):
        session = await ctx.open()
        host = _host(session)
        src = await session.region(4096, READ, fill=os.urandom(4096))
        dst = await session.region(4096, WRITE)
        host.withdraw(src if refused_kind == Ft.READ else dst)  # without telling the agent
        job = await session.submit(Kind.COPY, src.span(), dst.span())
        await _ended(session)
        assert [f.type for f in host.refused] == [refused_kind]
        late = [f for f in host.after_refusal if f.type != Ft.CAPSULE]
        assert late == [], f"the agent went on after the refusal: {late}"
        if refused_kind == Ft.READ:  # nothing was sent behind it: the job gets no COMPLETION
            assert host.after_refusal == [], host.after_refusal
            found = await session.job(job)
            assert (found.state, found.completion.status.code) == (job_pb2.JOB_STATE_FAILED, 14)
        assert host.capsules.empty(), "a COMPLETION was delivered for the refused job"


async def unanswered_requests(ctx: Ctx) -> None:
    """DP-3-7 (short profile: op_timeout 1 s), also for a job that has ended."""
    session = await ctx.open("short")
    job, _, _ = await session.held_copy()
    await session.send(wire.cancel(job))
    assert (await session.completion_for(job)).state == St.CANCELLED
    posted = time.monotonic()
    await asyncio.sleep(TIMERS["op_timeout"] * 0.6)
    assert (await session.get()).state == session_pb2.SESSION_STATE_ACTIVE, "failed too early"
    await _ended(session)
    assert time.monotonic() - posted < TIMERS["op_timeout"] + PROMPT


async def unanswered_requests_bounded(ctx: Ctx) -> None:
    """DP-3-9: a host that goes on submitting jobs and answers none of their WRITEs."""
    session = await ctx.open(queue_depth=1)
    host = _host(session)
    limit = max(1024, 16 * 1)  # the spec's bound at queue_depth 1
    host.hold_writes = True
    dst = await session.region(limit + 1, WRITE)
    for i in range(limit):  # an inline COPY: its only request is its last WRITE
        job = session.next_id()
        await session.send(wire.submit_inline(job, Kind.COPY, b"w", dst.span(i, 1)))
        assert (await session.completion_for(job)).state == St.SUCCEEDED
    assert len(host.held_writes) == limit
    assert (await session.get()).state == session_pb2.SESSION_STATE_ACTIVE, "ended too early"
    job = session.next_id()
    await session.send(wire.submit_inline(job, Kind.COPY, b"w", dst.span(limit, 1)))
    await _ended(session)
    assert len(host.held_writes) == limit, "the agent sent the request past the bound"


async def a_host_that_does_not_read(ctx: Ctx) -> None:
    """DP-3-10: a host that goes on sending SUBMITs and reads nothing."""
    session = await ctx.open(queue_depth=1)
    host = _host(session)
    host.stop_reading()
    data = os.urandom(16)
    sent = 0
    failed = False
    while not failed and sent < 2_000_000:  # ~10 MB the sockets' buffers hold, then 1024
        batch = [wire.submit_inline(session.next_id(), Kind.CRC32C, data) for _ in range(256)]
        try:
            await asyncio.wait_for(host.send(b"".join(map(wire.capsule_frame, batch))), 1)
        except (TimeoutError, OSError):
            break  # the agent stopped reading: it ended the data plane
        sent += len(batch)
        if sent % 8192 == 0:
            failed = (await session.get()).state == session_pb2.SESSION_STATE_FAILED
    state = await session.wait_state(session_pb2.SESSION_STATE_FAILED)
    assert state.state == session_pb2.SESSION_STATE_FAILED, f"{sent} SUBMITs unread: {state}"
    assert state.error.code == 14, state


def _agent_queues(host: socket.socket) -> tuple[int, int]:
    """The agent's end of the host's connection, from the kernel (/proc/net/tcp):
    (bytes in its send queue, bytes in its receive queue). The agent runs here."""
    agent_ip, agent_port = host.getpeername()[:2]
    host_ip, host_port = host.getsockname()[:2]

    def hex_end(ip: str, port: int) -> str:
        packed = socket.inet_aton(ip)[::-1].hex().upper()  # the kernel's byte order
        return f"{packed}:{port:04X}"

    local, remote = hex_end(agent_ip, agent_port), hex_end(host_ip, host_port)
    with open("/proc/net/tcp", encoding="ascii") as table:  # noqa: PTH123
        for line in table.readlines()[1:]:
            fields = line.split()
            if fields[1] == local and fields[2] == remote:
                tx, rx = fields[4].split(":")
                return int(tx, 16), int(rx, 16)
    raise AssertionError(f"the agent's end {agent_ip}:{agent_port} is not on this machine")


async def frames_the_host_takes_none_of(ctx: Ctx) -> None:
    """DP-3-11 (short profile: op_timeout 1 s): a host that stops reading short of
    DP-3-10's bound, with jobs that make no READ or WRITE (inline CRC32C)."""
    session = await ctx.open("short", queue_depth=64)  # DP-3-10's bound: 1024 frames
    host = _host(session)
    assert host.sock is not None
    host.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills sooner
    host.stop_reading()
    data = os.urandom(16)
    kernel, completed, steady = -1, 0, 0
    for _ in range(2_000):  # the kernel's buffers hold some ten thousand COMPLETIONs
        # 128 a batch: three steady batches' COMPLETIONs stay well under the bound
        batch = [wire.submit_inline(session.next_id(), Kind.CRC32C, data) for _ in range(128)]
        await asyncio.wait_for(host.send(b"".join(map(wire.capsule_frame, batch))), WAIT)
        await asyncio.sleep(0.02)
        queued, unread = _agent_queues(host.sock)
        inq = int.from_bytes(
            fcntl.ioctl(host.sock.fileno(), termios.FIONREAD, bytes(4)), sys.byteorder
        )
        done = (await session.get()).counters.jobs_completed
        # The agent read and ran every SUBMIT, and the bytes in the kernel's buffers
        # (its send queue, the host's receive queue) did not grow: the COMPLETIONs
        # of the last jobs wait in the agent's memory.
        grew = queued + inq != kernel
        steady = 0 if grew or unread or done != completed + len(batch) else steady + 1
        kernel, completed = queued + inq, done
        if steady >= 2:
            break
    else:
        raise AssertionError("the kernel's buffers never stopped taking the COMPLETIONs")
    stopped = time.monotonic()
    state = await session.get()
    assert state.state == session_pb2.SESSION_STATE_ACTIVE, f"ended before the wait: {state}"
    state = await session.wait_state(session_pb2.SESSION_STATE_FAILED)
    assert state.state == session_pb2.SESSION_STATE_FAILED, f"{completed} jobs: {state}"
    assert state.error.code == 14, state
    assert time.monotonic() - stopped < TIMERS["op_timeout"] + 1 + PROMPT


async def failed_before_the_close(ctx: Ctx) -> None:
    """DP-4-6: the connection's end seen, `GetSession` answers FAILED at once (20 rounds)."""
    for data in [wire.hello(os.urandom(32)), wire.frame(9)] * 10:
        session = await ctx.open()
        host = _host(session)
        await host.send(data)
        await asyncio.wait_for(host.eof.wait(), WAIT)
        state = await session.get()
        assert state.state == session_pb2.SESSION_STATE_FAILED, state
        assert state.error.code == 14, state
        await session.close()


async def peer_closed(ctx: Ctx) -> None:
    """DP-3-8: the host closes its end, with or without a job running."""
    for busy in (False, True):
        session = await ctx.open()
        if busy:
            await session.slow_write()
        host = _host(session)
        assert host.sock is not None
        with contextlib.suppress(OSError):
            host.sock.shutdown(socket.SHUT_WR)
        await _ended(session)


_ = Span

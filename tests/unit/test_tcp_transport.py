"""The tcp transport on loopback: RC queue-pair semantics, the handshake, hostile peers.

The agent's side runs on a real data-plane reactor thread, the host's on this event
loop, as in the agent and the SDK.
"""

import asyncio
import functools
import os
import random
import select
import socket
import struct
import threading
import time

import pytest
import pytest_asyncio

from dpu_wire.transport import tcp
from dpu_wire.transport.base import (
    Access,
    PeerClosed,
    RemoteAccessError,
    TcpAddress,
    TransportError,
)
from tests.links import AgentEnd, reactor, tcp_pair

pytestmark = pytest.mark.asyncio


@pytest_asyncio.fixture
async def pair():
    async with reactor() as r:
        host, agent = await tcp_pair(r)
        yield host, agent
        await agent.close()
        await host.close()


async def test_read_and_write_move_every_byte(pair):
    host, agent = pair
    size = 4 << 20
    src = host.link.register(size, Access.REMOTE_READ)
    dst = host.link.register(size, Access.REMOTE_WRITE)
    data = os.urandom(size)
    src.view[:] = data
    staging = agent.staging(size)
    await agent.read(staging, 0, size, src.addr, src.rkey)
    assert bytes(staging.view) == data
    await agent.write(staging, 0, size, dst.addr, dst.rkey)
    assert bytes(dst.view) == data


async def test_partial_spans_land_at_the_right_offsets(pair):
    host, agent = pair
    region = host.link.register(4096, Access.REMOTE_READ | Access.REMOTE_WRITE)
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
async def test_a_refused_access_ends_the_link_on_both_sides_as_on_verbs(
    pair, access, op, offset, length, key_delta
):
    host, agent = pair
    region = host.link.register(4096, access)
    staging = agent.staging(64)
    with pytest.raises(RemoteAccessError):
        await getattr(agent, op)(staging, 0, length, region.addr + offset, region.rkey + key_delta)
    ok = host.link.register(64, Access.REMOTE_READ)
    with pytest.raises(TransportError):
        await agent.read(staging, 0, 64, ok.addr, ok.rkey)
    with pytest.raises(RemoteAccessError):
        await host.recv()  # the host refused it and knows its data plane is over


async def test_capsules_both_ways_in_order(pair):
    host, agent = pair
    for i in range(50):
        host.send(b"h%d" % i)
    for i in range(50):
        await agent.send(b"a%d" % i)
    assert [await agent.recv() for _ in range(50)] == [b"h%d" % i for i in range(50)]
    assert [await host.recv() for _ in range(50)] == [b"a%d" % i for i in range(50)]


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
    assert await host.recv() == b"done"
    assert bytes(region.view) == b"\x5a" * (1 << 20)


async def test_peer_gone_fails_pending_and_later_ops(pair):
    host, agent = pair
    region = host.link.register(64, Access.REMOTE_READ)
    await host.close()
    staging = agent.staging(64)
    with pytest.raises(PeerClosed):
        await agent.recv()
    with pytest.raises(TransportError):
        await agent.read(staging, 0, 64, region.addr, region.rkey)


async def test_close_is_idempotent(pair):
    host, agent = pair
    await agent.close()
    agent.link.close()
    await host.close()
    await host.close()


# ---------------------------------------------------------------- a hostile host


class RawHost:
    """A host written from the spec by hand: a listener, HELLO, then raw frames."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.setblocking(False)
        self.token = tcp.new_token()
        self.address = TcpAddress("127.0.0.1", self.listener.getsockname()[1], self.token)
        self.sock: socket.socket | None = None

    async def accept(self, hello: bytes | None = None) -> socket.socket:
        loop = asyncio.get_running_loop()
        sock, _ = await loop.sock_accept(self.listener)
        sock.setblocking(False)
        token = self.token if hello is None else hello
        await loop.sock_sendall(sock, tcp.pack(tcp.FrameType.HELLO, length=len(token)) + token)
        self.sock = sock
        return sock

    async def recv_exactly(self, n: int) -> bytes:
        assert self.sock is not None
        loop = asyncio.get_running_loop()
        data = b""
        while len(data) < n:
            chunk = await loop.sock_recv(self.sock, n - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return data

    async def frame(self) -> tcp.Frame:
        kind, status, _r, req_id, addr, rkey, length = tcp.FRAME.unpack(
            await self.recv_exactly(tcp.FRAME.size)
        )
        return tcp.Frame(kind, status, req_id, addr, rkey, length)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.listener.close()


@pytest_asyncio.fixture
async def raw():
    host = RawHost()
    async with reactor() as r:
        yield host, r
    host.close()


async def connected(raw_host: RawHost, r) -> AgentEnd:
    (sock, token), _ = await asyncio.gather(tcp.dial(raw_host.address), raw_host.accept())
    assert (await raw_host.frame()).kind == tcp.FrameType.HELLO
    assert await raw_host.recv_exactly(tcp.TOKEN_BYTES) == token
    agent = AgentEnd(tcp.TcpAgentLink(sock, token), r)
    await agent.start()
    return agent


async def test_the_agent_sends_nothing_to_a_listener_without_the_sessions_token(raw):
    host, _ = raw
    loop = asyncio.get_running_loop()
    dialing = asyncio.ensure_future(tcp.dial(host.address, hello_timeout=1.0))
    sock, _ = await loop.sock_accept(host.listener)  # an unrelated listener: no HELLO
    sock.setblocking(False)
    with pytest.raises(TransportError, match=tcp.HANDSHAKE_FAILED):
        await asyncio.wait_for(asyncio.shield(dialing), 10)
    got = b""
    while chunk := await asyncio.wait_for(loop.sock_recv(sock, 4096), 5):  # until EOF
        got += chunk
    sock.close()
    assert got == b"", "the agent sent bytes to a listener that never proved itself"


async def test_a_wrong_token_gets_nothing_and_the_same_error(raw):
    host, _ = raw
    dialing = asyncio.ensure_future(tcp.dial(host.address))
    sock = await host.accept(hello=os.urandom(tcp.TOKEN_BYTES))
    with pytest.raises(TransportError) as refused:
        await dialing
    result = refused.value
    assert str(result) == tcp.HANDSHAKE_FAILED
    loop = asyncio.get_running_loop()
    assert await asyncio.wait_for(loop.sock_recv(sock, 4096), 5) == b""  # closed, sent nothing


async def test_closed_and_wrong_listeners_read_the_same(raw):
    host, _ = raw
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    with pytest.raises(TransportError) as refused:
        await tcp.dial(TcpAddress("127.0.0.1", port, host.token))
    assert str(refused.value) == tcp.HANDSHAKE_FAILED


async def test_a_write_ack_is_no_answer_to_a_read(raw):
    host, r = raw
    agent = await connected(host, r)
    staging = agent.staging(4096)
    staging.view[:] = b"\x01" * 4096
    reading = asyncio.ensure_future(agent.read(staging, 0, 4096, 0x1000, 7))
    request = await host.frame()
    assert request.kind == tcp.FrameType.READ
    host.sock.send(tcp.pack(tcp.FrameType.WRITE_ACK, 0, request.req_id))  # wrong type
    with pytest.raises(TransportError, match="answers no outstanding"):
        await reading
    assert bytes(staging.view) == b"\x01" * 4096, "the staging buffer was touched"
    await agent.close()


async def test_a_write_ack_for_a_write_still_queued_ends_the_link(raw):
    """A host that stops reading sees a WRITE's header and acknowledges it before its
    payload left the agent (an outside review): believed, the job's staging buffer could
    be reused while the old WRITE still waits to be sent with another job's bytes."""
    host, r = raw
    agent = await connected(host, r)
    staging = agent.staging(64 << 20)
    writing = asyncio.ensure_future(agent.write(staging, 0, 64 << 20, 0x1000, 7))
    request = await host.frame()  # the header; the 64 MiB payload cannot all be in flight
    assert request.kind == tcp.FrameType.WRITE
    await asyncio.sleep(0.2)  # the agent has sent what the socket took
    host.sock.send(tcp.pack(tcp.FrameType.WRITE_ACK, 0, request.req_id))
    with pytest.raises(TransportError, match="answers no outstanding WRITE"):
        await asyncio.wait_for(writing, 10)
    await agent.close()


@pytest.mark.parametrize(
    "frame",
    [
        tcp.pack(tcp.FrameType.READ_RESP, 0, 99, length=0),  # unknown request
        tcp.pack(tcp.FrameType.READ, 0, 1, 0x1000, 1, 16),  # a host does not READ
        tcp.pack(tcp.FrameType.HELLO, length=32) + bytes(32),  # a second HELLO
        tcp.pack(tcp.FrameType.CAPSULE, length=257) + bytes(257),  # too long
        bytes([0xFF]) * 24,  # no such type
    ],
)
async def test_a_protocol_violation_ends_the_link(raw, frame):
    host, r = raw
    agent = await connected(host, r)
    host.sock.send(frame)
    with pytest.raises(TransportError):
        await asyncio.wait_for(agent.recv(), 10)
    await agent.close()


async def test_a_read_the_host_never_answers_fails_the_link_after_op_timeout(raw):
    host, r = raw
    (sock, token), _ = await asyncio.gather(tcp.dial(host.address), host.accept())
    await host.recv_exactly(tcp.FRAME.size + tcp.TOKEN_BYTES)
    agent = AgentEnd(tcp.TcpAgentLink(sock, token, op_timeout=1.0), r)
    await agent.start()
    with pytest.raises(TransportError, match="unanswered"):
        await asyncio.wait_for(agent.read(agent.staging(64), 0, 64, 0x1000, 1), 10)
    await agent.close()


async def test_many_frames_per_system_call():
    """A burst of capsules leaves in few sendmsg calls and arrives whole, in order."""
    async with reactor() as r:
        host, agent = await tcp_pair(r)
        link = host.link
        assert isinstance(link, tcp.TcpHostLink)
        assert link._stream is not None
        capsules = [struct.pack("<I", i) * 20 for i in range(2000)]
        for capsule in capsules:
            link._stream.queue(tcp.pack(tcp.FrameType.CAPSULE, length=len(capsule)), capsule)
        link._flush()
        assert [await agent.recv() for _ in capsules] == capsules
        await agent.close()
        await host.close()


class _Capsules:
    """A LinkSink that keeps the capsules it is handed."""

    def __init__(self) -> None:
        self.capsules: list[bytes] = []

    def on_capsule(self, data: memoryview) -> None:
        self.capsules.append(bytes(data))

    def on_done(self, token: int, error: TransportError | None) -> None:
        raise AssertionError(f"no operation was posted (token {token}, {error})")


async def test_a_poll_hands_over_at_most_its_budget_and_the_rest_on_later_polls():
    """One read of the socket brings a whole burst (64 KiB of small capsules, 1500 here);
    a poll hands over `budget` of them, and the others wait in the link for the next
    polls (`backlog`), in order, none lost: the reactor's per-pass budget holds."""
    mine, peer = socket.socketpair()
    link = tcp.TcpAgentLink(mine, tcp.new_token())
    capsules = [struct.pack("<QQ", i, ~i & 0xFFFF_FFFF_FFFF_FFFF) for i in range(1500)]
    peer.sendall(b"".join(tcp.pack(tcp.FrameType.CAPSULE, length=16) + c for c in capsules))
    sink = _Capsules()
    budget = 64
    handed: list[int] = []
    for _ in range(len(capsules) // budget + 1):
        before = len(sink.capsules)
        assert link.poll(sink, budget) == len(sink.capsules) - before
        handed.append(len(sink.capsules) - before)
        assert handed[-1] <= budget
        assert link.backlog == (len(sink.capsules) < len(capsules))
    assert sink.capsules == capsules
    assert handed == [budget] * (len(capsules) // budget) + [len(capsules) % budget]
    assert link.poll(sink, budget) == 0  # the socket is drained too
    assert not link.backlog
    link.close()
    peer.close()


async def test_frames_the_host_takes_none_of_end_the_link_after_op_timeout():
    """DP-3-11: a host that stops reading short of DP-3-10's bound, and makes no READ or
    WRITE wait, kept the agent's frames in memory for as long as its session lived.
    Now they may wait `op_timeout` with the socket taking none of their bytes; any
    byte it takes starts the wait again."""
    mine, peer = socket.socketpair()
    for sock, option in ((mine, socket.SO_SNDBUF), (peer, socket.SO_RCVBUF)):
        sock.setsockopt(socket.SOL_SOCKET, option, 4096)
    link = tcp.TcpAgentLink(mine, tcp.new_token(), op_timeout=5.0, queue_depth=64)
    capsule = bytes(200)
    for _ in range(200):  # far more than the two small buffers hold, under the bound
        link.post_send(capsule)
    link.flush()
    stuck = link._stream.stuck_since
    assert stuck is not None, "every frame went to the kernel: the buffers are too large"
    assert link.wants_write
    assert not link.overdue(stuck + 4.9)
    await asyncio.sleep(0.2)
    peer.recv(16384)  # the host reads a little: the socket takes more, the wait restarts
    link.flush()
    restarted = link._stream.stuck_since
    assert restarted is not None
    assert restarted >= stuck + 0.2
    assert not link.overdue(stuck + 5.1)
    assert link.overdue(restarted + 5.1)
    assert link.error is not None
    assert "read nothing for 5 s" in str(link.error)
    link.close()
    peer.close()


async def test_frames_all_taken_by_the_socket_never_make_the_link_overdue():
    mine, peer = socket.socketpair()
    link = tcp.TcpAgentLink(mine, tcp.new_token(), op_timeout=1.0)
    link.post_send(bytes(64))
    link.flush()
    assert link._stream.stuck_since is None
    assert not link.overdue(time.monotonic() + 3600)
    link.close()
    peer.close()


class _Recorder(tcp.FrameHandler):
    """Frames as a FrameStream hands them over: READ_RESP payloads into fresh buffers
    (large ones are read straight into them), WRITE payloads discarded."""

    def __init__(self) -> None:
        self.frames: list[tuple[int, int, bytes | None]] = []

    def payload_target(self, frame: tcp.Frame) -> memoryview | None:
        if frame.kind == tcp.FrameType.WRITE:
            return None
        return memoryview(bytearray(frame.length))

    def on_frame(self, frame: tcp.Frame, payload: memoryview | None) -> None:
        self.frames.append((frame.kind, frame.req_id, None if payload is None else bytes(payload)))


@pytest.mark.parametrize("limit", [1, 7, 64])
async def test_a_limited_receive_loses_and_reorders_nothing(limit):
    """Whatever the limit and wherever it falls (in a buffered burst, before a payload
    read straight into its target, before one to discard), the frames come out whole
    and in order, `limit` at most per call; `pending` says when the buffer still holds
    some that no readiness of the socket would report."""
    rng = random.Random(limit)  # noqa: S311 - test data, not secrets
    kinds = [tcp.FrameType.CAPSULE, tcp.FrameType.WRITE_ACK, tcp.FrameType.WRITE]
    expected: list[tuple[int, int, bytes | None]] = []
    wire = bytearray()
    for i in range(1, 3001):
        kind = tcp.FrameType.READ_RESP if i % 500 == 0 else rng.choice(kinds)
        size = {tcp.FrameType.WRITE_ACK: 0, tcp.FrameType.READ_RESP: 150_000}.get(kind)
        payload = rng.randbytes(rng.randrange(0, 257) if size is None else size)
        req_id = 0 if kind == tcp.FrameType.CAPSULE else i  # a capsule's is 0 (DP-3-1)
        if kind == tcp.FrameType.CAPSULE:
            payload = i.to_bytes(4, "little") + payload[4:]  # its place, to see the order
        wire += tcp.pack(kind, 0, req_id, length=len(payload)) + payload
        kept = kind in {tcp.FrameType.CAPSULE, tcp.FrameType.READ_RESP}
        expected.append((kind, req_id, payload if kept else None))
    mine, peer = socket.socketpair()
    handler = _Recorder()
    stream = tcp.FrameStream(mine, handler)
    sender = threading.Thread(target=peer.sendall, args=(bytes(wire),))
    sender.start()
    while True:
        before = len(handler.frames)
        assert stream.receive(limit=limit) == len(handler.frames) - before <= limit
        if len(handler.frames) == len(expected):
            break
        if not stream.pending:
            assert select.select([mine], [], [], 10)[0], "frames are lost"
    sender.join()
    assert handler.frames == expected
    assert not stream.pending
    stream.close()
    peer.close()


async def test_frames_read_in_one_go_beyond_the_budget_all_arrive():
    """A burst that one read takes whole (1000 small capsules, about 40 KiB) and then
    nothing more: the socket's readiness never reports what the first pass left in the
    link's buffer, so the reactor must poll the link again by itself."""
    async with reactor() as r:
        host, agent = await tcp_pair(r)
        link = host.link
        assert isinstance(link, tcp.TcpHostLink)
        assert link._stream is not None
        capsules = [struct.pack("<QQ", i, i) for i in range(1000)]
        for capsule in capsules:
            link._stream.queue(tcp.pack(tcp.FrameType.CAPSULE, length=len(capsule)), capsule)
        link._flush()
        got = [await asyncio.wait_for(agent.recv(), 10) for _ in capsules]
        assert got == capsules
        await agent.close()
        await host.close()


class _CountingSends:
    """A socket that records how many buffers each sendmsg call carried."""

    def __init__(self, sock: socket.socket, calls: list[int]) -> None:
        self._sock = sock
        self._calls = calls

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)

    def sendmsg(self, buffers: list[memoryview]) -> int:
        self._calls.append(len(buffers))
        return self._sock.sendmsg(buffers)


async def test_sends_within_one_turn_of_the_loop_leave_in_two_system_calls():
    """The first capsule of a turn goes out at once; those sent after it in the same turn
    (tasks woken by one batch of COMPLETIONs, say) leave together at the next turn."""
    async with reactor() as r:
        host, agent = await tcp_pair(r)
        link = host.link
        assert isinstance(link, tcp.TcpHostLink)
        assert link._stream is not None
        calls: list[int] = []
        link._stream.sock = _CountingSends(link._stream.sock, calls)  # type: ignore[assignment]
        host.send(b"first")
        assert calls == [2]  # header and payload, before the loop turned
        for i in range(31):
            host.send(b"next%d" % i)
        assert calls == [2]
        expected = [b"first"] + [b"next%d" % i for i in range(31)]
        assert [await agent.recv() for _ in expected] == expected
        assert calls == [2, 62]
        await asyncio.sleep(0)
        host.send(b"later")  # a new turn: at once again
        assert calls == [2, 62, 2]
        assert await agent.recv() == b"later"
        await agent.close()
        await host.close()


@pytest.mark.parametrize(
    ("queue_depth", "writes"), [(1, [2] * 10), (8, [4] * 5), (16, [8, 8, 4]), (64, [20])]
)
async def test_the_agent_writes_its_capsules_out_every_quarter_queue_depth(queue_depth, writes):
    """Ten capsules posted in one pass of the reactor leave every `queue_depth // 4` (at
    least 1; the rest at the end of the pass): the host starts on the first ones
    meanwhile. `writes`: the buffers of each sendmsg, a header and a payload each."""
    async with reactor() as r:
        host, agent = await tcp_pair(r, queue_depth)
        link = agent.link
        assert isinstance(link, tcp.TcpAgentLink)
        calls: list[int] = []
        capsules = [b"c%d" % i for i in range(10)]

        def post_all() -> None:
            link._stream.sock = _CountingSends(link._stream.sock, calls)  # type: ignore[assignment]
            for capsule in capsules:
                link.post_send(capsule)
            r.wake(link)  # the pass ends with the owner's end_pass: its flush

        await r.call_async(post_all)
        assert [await host.recv() for _ in capsules] == capsules
        assert calls == writes
        await agent.close()
        await host.close()


class _CountingRecvs:
    """A socket that records what each recv_into returned (a size, or "EAGAIN")."""

    def __init__(self, sock: socket.socket, calls: list[int | str]) -> None:
        self._sock = sock
        self._calls = calls

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)

    def recv_into(self, view: memoryview) -> int:
        try:
            n = self._sock.recv_into(view)
        except BlockingIOError:
            self._calls.append("EAGAIN")
            raise
        self._calls.append(n)
        return n


async def test_a_short_read_ends_the_receive_without_an_empty_read():
    """A read that returns less than the room offered drained the socket: the link waits
    for readiness again instead of reading once more into EAGAIN (an exception each)."""
    async with reactor() as r:
        host, agent = await tcp_pair(r)
        link = agent.link
        assert isinstance(link, tcp.TcpAgentLink)
        calls: list[int | str] = []

        def count() -> None:
            link._stream.sock = _CountingRecvs(link._stream.sock, calls)  # type: ignore[assignment]

        await r.call_async(count)
        # The link's first poll, in the pass that added it, reads without readiness; on a
        # slow machine that pass may run `count` too. One capsule first ends that pass.
        host.send(b"first")
        assert await agent.recv() == b"first"
        calls.clear()
        for i in range(20):
            host.send(b"capsule %d" % i)
            assert await agent.recv() == b"capsule %d" % i
        assert calls
        assert "EAGAIN" not in calls
        await agent.close()
        await host.close()


async def test_a_frame_that_arrives_in_pieces_is_read_whole():
    """Short reads end a receive; the rest of a frame, header or payload, comes with the
    socket's next readiness."""
    async with reactor() as r:
        host, agent = await tcp_pair(r)
        link = host.link
        assert isinstance(link, tcp.TcpHostLink)
        assert link._stream is not None
        capsule = os.urandom(200)  # a link without inline sources takes 256 at most
        frame = tcp.pack(tcp.FrameType.CAPSULE, length=len(capsule)) + capsule
        for cut in (3, 20, 40, 100, len(frame) - 1):
            link._stream.sock.sendall(frame[:cut])
            await asyncio.sleep(0.02)  # the agent reads the piece on its own
            link._stream.sock.sendall(frame[cut:])
            assert await agent.recv() == capsule
        await agent.close()
        await host.close()


async def test_a_pass_that_finishes_a_send_needs_no_further_pass():
    """A capsule sent with a token is reported done in the pass that sent it (tcp knows
    once the bytes went to the kernel), not in one more pass of the reactor."""
    async with reactor() as r:
        host, agent = await tcp_pair(r)
        await agent.send(b"warm-up")
        assert await host.recv() == b"warm-up"
        before = r.passes
        for i in range(20):
            await agent.send(b"capsule %d" % i)
            assert await host.recv() == b"capsule %d" % i
        assert r.passes - before <= 20 + 3  # one pass per send (and a stray timer or two)
        await agent.close()
        await host.close()


class _ShortSends:
    """A socket whose sendmsg takes at most `limit` bytes, as a full kernel buffer does."""

    def __init__(self, sock: socket.socket, limit: int) -> None:
        self._sock = sock
        self.limit = limit

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)

    def sendmsg(self, buffers: list[memoryview]) -> int:
        out, room = [], self.limit
        for buffer in buffers:
            if not room:
                break
            out.append(buffer[:room])
            room -= len(out[-1])
        return self._sock.sendmsg(out)


@pytest.mark.parametrize("limit", [1, 7, 100, 5000, 1 << 20])
async def test_short_sends_resume_where_they_stopped(limit):
    """Whatever each sendmsg takes, the bytes leave whole and in order, and each frame's
    `sent` callback runs once its last byte went, not before."""
    mine, peer = socket.socketpair()
    stream = tcp.FrameStream(mine, None)  # type: ignore[arg-type]  # sends only
    stream.sock = _ShortSends(mine, limit)  # type: ignore[assignment]
    frames = [
        (tcp.pack(tcp.FrameType.CAPSULE, length=len(p)), p)
        for p in (b"a" * 10, b"", os.urandom(3000), b"b" * 70, os.urandom(9000))
    ]
    sent_at: list[int] = []
    expected = b""
    for header, payload in frames:
        expected += header + payload
        stream.queue(header, payload or None, functools.partial(sent_at.append, len(expected)))
    received = b""
    while not stream.flush():
        received += peer.recv(1 << 20)
        # a callback only for frames whose bytes all went out
        assert all(end <= len(received) for end in sent_at)
    peer.setblocking(False)
    while len(received) < len(expected):
        received += peer.recv(1 << 20)
    assert received == expected
    assert sent_at == sorted(sent_at)
    assert len(sent_at) == len(frames)
    assert not stream.wants_write
    mine.close()
    peer.close()


async def test_a_failed_link_leaves_the_reactor_when_removed():
    """A failed link closed before it is removed has a descriptor of -1: removing it must
    still find its entry, or the reactor keeps it (and what it holds) and, once its
    failure is reported, goes on finishing its pass on every pass."""
    async with reactor() as r:
        host, agent = await tcp_pair(r)
        await agent.send(b"warm-up")
        assert await host.recv() == b"warm-up"
        await host.close()
        with pytest.raises(PeerClosed):
            await agent.recv()
        assert agent.link.fileno() != -1  # a failed link keeps its socket until closed
        await r.call_async(agent.link.close)
        assert agent.link.fileno() == -1
        await agent.close()

        def left() -> tuple[int, int, int]:
            return len(r._entries), len(r._touched), len(r._hot)

        assert await r.call_async(left) == (0, 0, 0)
        before = r.passes
        await asyncio.sleep(0.2)
        assert r.passes - before <= 5  # asleep (it wakes once a second), not spinning


async def test_a_kept_error_holds_no_frames():
    """`detached` clears the tracebacks of an error and of what caused it: a link keeps
    its error for its life, and a traceback would keep every frame it passes through."""

    def fail() -> None:
        try:
            raise ConnectionResetError(104, "reset")
        except OSError as exc:
            raise PeerClosed("reset by the peer") from exc

    with pytest.raises(PeerClosed) as caught:
        fail()
    error = caught.value
    chain = [error, error.__cause__]
    assert all(e is not None and e.__traceback__ is not None for e in chain)
    assert error.detached() is error
    assert [e.__traceback__ for e in chain if e is not None] == [None, None]


async def test_a_write_ack_leaves_with_the_capsule_its_completion_prompts():
    """A WRITE's ack, received with a COMPLETION, waits for the loop's next turn: the task
    the COMPLETION woke sends its next SUBMIT meanwhile, and both leave in one sendmsg."""
    async with reactor() as r:
        host, agent = await tcp_pair(r)
        link = host.link
        assert isinstance(link, tcp.TcpHostLink)
        assert link._stream is not None
        region = link.register(4096, Access.REMOTE_WRITE)
        staging = agent.staging(4096)
        staging.view[:] = b"x" * 4096
        calls: list[int] = []
        link._stream.sock = _CountingSends(link._stream.sock, calls)  # type: ignore[assignment]

        def post() -> None:  # a job's last WRITE and its COMPLETION, in one pass
            agent.link.post_write(staging, 0, 4096, region.addr, region.rkey, None)
            agent.link.post_send(b"completion", None)
            r.wake(agent.link)

        r.call(post)
        assert await host.recv() == b"completion"
        assert bytes(region.view) == b"x" * 4096
        host.send(b"next submit")
        assert await agent.recv() == b"next submit"
        assert calls == [3]  # the ack's header, the capsule's header and payload
        await agent.close()
        await host.close()


async def test_silent_connections_to_the_hosts_listener_do_not_keep_the_agent_out(monkeypatch):
    """Another local process connects to the SDK's listener first, many times, and says
    nothing (an outside attack pass: 3 silent connections made OpenSession fail after
    8 s, the SDK waiting on each in turn). The host checks every connection at once and
    drops the oldest for a newer one, so the agent's connection is taken at once."""
    monkeypatch.setattr(tcp, "HELLO_TIMEOUT", 1000.0)  # a silent connection is never timed out
    host = tcp.TcpHostLink()
    host.listen()
    port = host.address.port
    squatters = [socket.create_connection(("127.0.0.1", port)) for _ in range(96)]
    try:
        await asyncio.sleep(0.2)  # the host's loop accepts them
        sock, token = await tcp.dial(host.address)
        squatters.append(sock)
        await asyncio.wait_for(host.connect(TcpAddress("127.0.0.1", 0, token)), 10)
    finally:
        for squatter in squatters:
            squatter.close()
        await host.close()

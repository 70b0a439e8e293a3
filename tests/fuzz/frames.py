"""A hostile tcp data-plane host: scripts for the frame fuzz, and how one is played.

A script opens one session and plays the host's side of docs/data-plane.md sections
1.3 and 3 badly on purpose:

- the handshake (`Hello`): the right HELLO, sent whole or in pieces, or a wrong token,
  a wrong length, garbage, a HELLO cut short and the connection closed, a HELLO with
  frames glued behind it, two HELLOs;
- then up to `MAX_ACTIONS` actions: capsules (random bytes of at most 256, SUBMITs
  with random fields, INLINE SUBMITs whose length is right or wrong), frames with
  random headers and truncated or absent payloads, garbage, CAPSULE frames longer than
  the agent's limit (80 + inline_max, data-plane.md 2.8), a second HELLO, half a frame
  and a pause (a stall mid-frame), and copies whose READ this host answers with the
  wrong type, the wrong id, the wrong length, a refusal, late, or not at all;
- and the end: the connection closed (FIN or RST), then CloseSession.

What must hold whatever the script (`play` checks it): OpenSession succeeds exactly for
the scripts whose handshake is right and fails UNAVAILABLE otherwise, with no byte sent
to the host; every frame the agent sends is a CAPSULE, READ or WRITE with a valid header
and every capsule a valid COMPLETION; a script of well-formed frames leaves the session
ACTIVE; a session the agent failed has its connection closed; CloseSession answers OK.
The survival checks (process, memory, threads, slots, another client's latency) are
the test's, after the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import secrets
import socket
import struct
from typing import TYPE_CHECKING, Final

import grpc
from hypothesis import strategies as st

from dpu_wire.v1 import agent_pb2, session_pb2
from tests.conformance import wire
from tests.conformance.wire import Frame, Ft
from tests.fuzz.proto_strategies import weighted

if TYPE_CHECKING:
    from tests.conformance.harness import Stubs

MAX_ACTIONS: Final = 6
FAILS: Final = frozenset({"wrong_token", "wrong_length", "garbage", "truncated"})
GOOD_HELLO: Final = frozenset({"whole", "pieces"})
ANSWERS: Final = ("right", "wrong_type", "wrong_id", "wrong_length", "refused", "late", "never")
SRC: Final = (0x1000_0000, 0x1111)  # regions random SUBMITs name: (addr, rkey)
DST: Final = (0x2000_0000, 0x2222)
COPY: Final = (0x3000_0000, 0x3333)  # the source of a script's copies: their READs are known
REGION: Final = 8192


@dataclasses.dataclass(frozen=True)
class Hello:
    """How the host opens the connection."""

    game: str  # whole, pieces, wrong_token, wrong_length, garbage, truncated, glued, twice
    cut: int = 0  # truncated: bytes of the HELLO sent; wrong_length: the length field
    extra: bytes = b""  # garbage: the bytes; glued: what follows the HELLO
    pieces: tuple[int, ...] = ()  # pieces: where the HELLO is split


@dataclasses.dataclass(frozen=True)
class Action:
    kind: str  # capsule, frame, garbage, oversized, stall, hello, copy
    data: bytes = b""
    answer: str = ""  # copy: how its READ is answered
    pause: float = 0.0


@dataclasses.dataclass(frozen=True)
class Script:
    hello: Hello
    actions: tuple[Action, ...]
    reset: bool  # end with an RST (else FIN)

    @property
    def opens(self) -> bool:
        return self.hello.game not in FAILS

    @property
    def well_formed(self) -> bool:
        """Only what the spec allows: the link must survive it."""
        return self.hello.game in GOOD_HELLO and all(
            a.kind == "capsule" or (a.kind == "copy" and a.answer in ("right", "late"))
            for a in self.actions
        )


# ---------------------------------------------------------------- strategies

_U32 = st.one_of(st.sampled_from([0, 1, 32, 256, 257, 0xFFFF_FFFF]), st.integers(0, 0xFFFF_FFFF))


def _hello() -> st.SearchStrategy[Hello]:
    cuts = st.lists(st.integers(1, 55), min_size=1, max_size=3, unique=True)
    lengths = st.integers(0, 64).filter(lambda n: n != 32)
    return weighted(
        (st.just(Hello("whole")), 30),
        (cuts.map(lambda p: Hello("pieces", pieces=tuple(sorted(p)))), 4),
        (st.just(Hello("wrong_token")), 2),
        (lengths.map(lambda n: Hello("wrong_length", cut=n)), 2),
        (st.binary(min_size=1, max_size=80).map(lambda b: Hello("garbage", extra=b)), 2),
        (st.integers(0, 55).map(lambda n: Hello("truncated", cut=n)), 2),
        (st.binary(min_size=1, max_size=64).map(lambda b: Hello("glued", extra=b)), 2),
        (st.just(Hello("twice")), 1),
    )


def _frame_bytes() -> st.SearchStrategy[bytes]:
    @st.composite
    def build(draw: st.DrawFn) -> bytes:
        kind = draw(st.one_of(st.sampled_from([int(t) for t in Ft]), st.integers(0, 255)))
        length = draw(_U32)
        header = wire.frame(
            kind, draw(st.integers(0, 255)), draw(_U32), draw(st.integers(0, 2**64 - 1)),
            draw(_U32), length, draw(st.integers(0, 0xFFFF)),
        )  # fmt: skip
        payload = draw(st.binary(max_size=min(length, 300)))
        return header + payload

    return build()


def _capsule() -> st.SearchStrategy[bytes]:
    addrs = st.sampled_from([0, SRC[0], DST[0]]) | st.integers(0, 2**64 - 1)
    rkeys = st.sampled_from([0, SRC[1], DST[1]]) | _U32
    span = st.builds(wire.Span, addrs, st.integers(0, REGION + 1) | _U32, rkeys)

    @st.composite
    def submit(draw: st.DrawFn) -> bytes:
        return wire.submit(
            draw(st.integers(0, 2**64 - 1) | st.integers(1, 50)), draw(st.integers(0, 13)),
            draw(span), draw(span),
            deadline_ms=draw(st.sampled_from([0, 1, 50]) | _U32), flags=draw(st.integers(0, 3)),
            handle=draw(st.integers(0, 3)),
        )  # fmt: skip

    @st.composite
    def inline(draw: st.DrawFn) -> bytes:  # an INLINE SUBMIT, its length right or wrong
        data = draw(st.binary(max_size=INLINE_MAX + 1))
        said = draw(st.just(len(data)) | st.integers(0, INLINE_MAX + 2))
        return wire.submit_inline(
            draw(st.integers(1, 50)), draw(st.integers(0, 13)), data, draw(span),
            source=wire.Span(draw(st.sampled_from([0, 0, SRC[0]])), said, 0),
            handle=draw(st.integers(0, 3)),
        )  # fmt: skip

    return weighted(
        (submit(), 3),
        (inline(), 1),
        (st.integers(1, 60).map(wire.cancel), 1),
        (st.binary(max_size=256), 2),
    )


INLINE_MAX: Final = 4096  # the agent's default [dataplane] inline_max (data-plane.md 2.8)
CAPSULE_LIMIT: Final = 80 + INLINE_MAX  # a longer CAPSULE frame ends the data plane


def _oversized(length: int) -> Action:
    return Action("oversized", wire.frame(Ft.CAPSULE, length=length) + bytes(min(length, 512)))


def _stall(frame: bytes, cut: int, pause: float) -> Action:
    return Action("stall", frame[:cut], pause=pause)


def _action() -> st.SearchStrategy[Action]:
    pause = st.sampled_from([0.0, 0.0, 0.001, 0.01])
    return weighted(
        (_capsule().map(lambda c: Action("capsule", c)), 8),
        (st.sampled_from(ANSWERS).map(lambda a: Action("copy", answer=a)), 5),
        (_frame_bytes().map(lambda f: Action("frame", f)), 4),
        (st.binary(min_size=1, max_size=300).map(lambda b: Action("garbage", b)), 2),
        (st.integers(CAPSULE_LIMIT + 1, 0xFFFF_FFFF).map(_oversized), 1),
        (st.builds(_stall, _frame_bytes(), st.integers(1, 40), pause), 2),
        (st.binary(min_size=32, max_size=32).map(lambda b: Action("hello", wire.hello(b))), 1),
    )


def scripts() -> st.SearchStrategy[Script]:
    """Scripts (see the module docstring)."""
    return st.builds(
        Script,
        _hello(),
        st.lists(_action(), max_size=MAX_ACTIONS).map(tuple),
        st.booleans(),
    )


# ---------------------------------------------------------------- playing one


@dataclasses.dataclass
class Played:
    """What one script did and saw."""

    opened: grpc.StatusCode
    frames: int = 0  # frames the agent sent
    completions: int = 0
    failed: bool = False  # the agent failed the session
    must_fail: bool = False  # a violation the agent read in step: it must fail the session


class HostileHost:
    """One session's host side, as a script plays it."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.setblocking(False)
        self.token = secrets.token_bytes(32)
        self.sock: socket.socket | None = None
        self.buffer = bytearray()
        self.eof = False

    def endpoint(self) -> session_pb2.Endpoint:
        port = self.listener.getsockname()[1]
        return session_pb2.Endpoint(
            tcp=session_pb2.TcpEndpoint(host="127.0.0.1", port=port, token=self.token)
        )

    async def send(self, data: bytes) -> bool:
        """Send; False if the agent is gone already."""
        assert self.sock is not None
        try:
            await asyncio.get_running_loop().sock_sendall(self.sock, data)
        except OSError:
            return False
        return True

    async def handshake(self, hello: Hello) -> None:
        loop = asyncio.get_running_loop()
        self.sock, _ = await loop.sock_accept(self.listener)
        self.sock.setblocking(False)
        good = wire.hello(self.token)
        game = hello.game
        if game == "pieces":
            last = 0
            for cut in (*hello.pieces, len(good)):
                await self.send(good[last:cut])
                last = cut
                await asyncio.sleep(0.001)
        elif game == "wrong_token":
            await self.send(wire.hello(os.urandom(32)))
        elif game == "wrong_length":
            await self.send(wire.frame(Ft.HELLO, length=hello.cut) + os.urandom(hello.cut))
        elif game == "garbage":
            await self.send(hello.extra)
            with contextlib.suppress(OSError):  # the agent may have hung up already
                self.sock.shutdown(socket.SHUT_WR)  # no wait for the rest of a header
        elif game == "truncated":
            await self.send(good[: hello.cut])
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_WR)
        elif game == "glued":
            await self.send(good + hello.extra)
        elif game == "twice":
            await self.send(good + good)
        else:
            await self.send(good)

    async def read(self, n: int, timeout: float) -> bytes | None:  # noqa: ASYNC109
        """Exactly n bytes, or None at EOF or when `timeout` passes first."""
        assert self.sock is not None
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                while len(self.buffer) < n:
                    chunk = await loop.sock_recv(self.sock, 65536)
                    if not chunk:
                        self.eof = True
                        return None
                    self.buffer += chunk
        except TimeoutError:
            return None
        except OSError:  # a reset: the agent is gone as surely as at EOF
            self.eof = True
            return None
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        return data

    async def frame(self, timeout: float) -> tuple[Frame, bytes] | None:  # noqa: ASYNC109
        """The agent's next frame, checked against DP-3-1 (None: nothing came)."""
        header = await self.read(wire.FRAME.size, timeout)
        if header is None:
            return None
        f = Frame(*wire.FRAME.unpack(header))
        assert f.type in (Ft.CAPSULE, Ft.READ, Ft.WRITE), f"the agent sent {f}"
        assert (f.reserved, f.status) == (0, 0), f
        if f.type == Ft.CAPSULE:
            assert f.req_id == f.addr == f.rkey == 0, f
            assert 80 <= f.length <= 256, f
        else:
            assert f.req_id != 0, f
            assert 1 <= f.length <= 1 << 20, f
        payload = b""
        if f.type in (Ft.CAPSULE, Ft.WRITE):
            got = await self.read(f.length, 5)
            assert got is not None, f"the agent cut a {f} short"
            payload = got
        if f.type == Ft.CAPSULE:
            wire.parse_completion(payload)  # DP-2.4-1, or SpecViolation
        return f, payload

    def close(self, *, reset: bool) -> None:
        if self.sock is not None:
            if reset:
                with contextlib.suppress(OSError):
                    self.sock.setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                    )
            self.sock.close()
            self.sock = None
        self.listener.close()


async def _drain_frames(
    host: HostileHost,
    played: Played,
    timeout: float,  # noqa: ASYNC109
    *,
    want: int | None = None,
    synced: bool = True,
) -> Frame | None:
    """Read what the agent sends until `timeout` passes without a frame, or until a READ
    of the region with rkey `want` (returned). While the stream is in step (`synced`)
    other READs are answered and WRITEs acknowledged, as a host does."""
    while True:
        got = await host.frame(timeout)
        if got is None:
            return None
        f, _ = got
        played.frames += 1
        if f.type == Ft.CAPSULE:
            played.completions += 1
        elif f.type == Ft.READ and f.rkey == want:
            return f
        elif synced and f.type == Ft.READ:
            await _answer(host, f, "right")
        elif synced:
            await host.send(wire.frame(Ft.WRITE_ACK, 0, f.req_id))


async def _answer(host: HostileHost, read: Frame, how: str) -> None:
    data = os.urandom(read.length)
    answers = {
        "right": wire.frame(Ft.READ_RESP, 0, read.req_id, length=read.length) + data,
        "late": wire.frame(Ft.READ_RESP, 0, read.req_id, length=read.length) + data,
        "wrong_type": wire.frame(Ft.WRITE_ACK, 0, read.req_id),
        "wrong_id": wire.frame(Ft.READ_RESP, 0, read.req_id ^ 0x8000, length=read.length) + data,
        "wrong_length": wire.frame(Ft.READ_RESP, 0, read.req_id, length=read.length - 1) + data[1:],
        "refused": wire.frame(Ft.READ_RESP, 1, read.req_id),
    }  # fmt: skip
    if how in answers:
        await host.send(answers[how])


async def play(stubs: Stubs, script: Script, request_id: str) -> Played:
    """Play one script against the agent; assert what must hold (module docstring)."""
    host = HostileHost()
    try:
        return await _play(stubs, script, request_id, host)
    finally:
        host.close(reset=script.reset)


async def _play(stubs: Stubs, script: Script, request_id: str, host: HostileHost) -> Played:
    request = session_pb2.OpenSessionRequest(
        request_id=request_id,
        transport=agent_pb2.TRANSPORT_TCP,
        queue_depth=8,
        client_label="fuzz",
        host_endpoint=host.endpoint(),
    )
    accepting = asyncio.ensure_future(host.handshake(script.hello))
    refused: grpc.aio.AioRpcError | None = None
    try:
        reply = await stubs.sessions.OpenSession(request, timeout=20)
    except grpc.aio.AioRpcError as exc:
        refused = exc
    await asyncio.wait_for(accepting, 5)
    if refused is not None:
        assert not script.opens, f"OpenSession failed: {refused.code()} {refused.details()}"
        assert refused.code() == grpc.StatusCode.UNAVAILABLE, refused
        assert await host.read(1, 5) is None, "the agent sent bytes before a valid HELLO"
        return Played(refused.code())
    assert script.opens, f"OpenSession took the handshake {script.hello}"
    played = Played(grpc.StatusCode.OK)
    agent_hello = await host.read(56, 10)
    assert agent_hello is not None
    assert agent_hello == wire.hello(reply.agent_endpoint.tcp.token), agent_hello
    try:
        await _actions(stubs, script, reply.name, host, played)
        await _drain_frames(host, played, 0.001, synced=script.well_formed)
        state = await _state(stubs, reply.name, wait=played.must_fail)
        played.failed = state == session_pb2.SESSION_STATE_FAILED
        assert played.failed or not played.must_fail, f"a violation left the session {state}"
        if script.well_formed:
            assert state == session_pb2.SESSION_STATE_ACTIVE, (
                f"a well-formed script failed the session: {state}"
            )
        if played.failed:  # the agent closed its end: EOF once the rest is read
            while not host.eof and await host.frame(5) is not None:
                pass
            assert host.eof, "the session is FAILED but its connection stays open"
    finally:
        host.close(reset=script.reset)
        await stubs.sessions.CloseSession(
            session_pb2.CloseSessionRequest(name=reply.name, request_id=request_id + "-close"),
            timeout=20,
        )
    return played


async def _state(stubs: Stubs, name: str, *, wait: bool) -> int:
    """The session's state; with `wait`, once it is FAILED (or 2 s passed: the session is
    never watched, and the agent closes it after first_watch_timeout, 5 s)."""
    for _ in range(100):
        found = await stubs.sessions.GetSession(session_pb2.GetSessionRequest(name=name))
        if not wait or found.state == session_pb2.SESSION_STATE_FAILED:
            break
        await asyncio.sleep(0.02)
    return int(found.state)


async def _actions(
    stubs: Stubs, script: Script, name: str, host: HostileHost, played: Played
) -> None:
    """Play the script's actions. While the stream is in step with the agent (only
    whole frames sent, every READ answered right), a copy's READ must come; after that
    the host cannot know how the agent parses what follows, and does not wait."""
    if script.actions:
        await _advertise(stubs, name)
    synced = script.hello.game in GOOD_HELLO
    late: list[Frame] = []
    for number, action in enumerate(script.actions):
        if action.kind == "copy":
            if not await _copy(host, played, 1000 + number, action.answer, synced, late):
                return
            bad = action.answer not in ("right", "late", "never")
            played.must_fail = played.must_fail or (synced and bad)
            synced = synced and action.answer in ("right", "late")
            continue
        data = wire.capsule_frame(action.data) if action.kind == "capsule" else action.data
        if not await host.send(data):
            return
        played.must_fail = played.must_fail or (synced and action.kind in ("hello", "oversized"))
        synced = synced and action.kind == "capsule"
        if action.pause:
            await asyncio.sleep(action.pause)
        for read in late:
            await _answer(host, read, "late")
        late.clear()
    for read in late:
        await _answer(host, read, "late")


async def _advertise(stubs: Stubs, name: str) -> None:
    regions = [
        session_pb2.MemoryRegion(
            name=f"{name}/regions/{rid}", addr=addr, length=REGION, rkey=rkey, access=[access]
        )
        for rid, (addr, rkey), access in (
            ("src", SRC, session_pb2.REGION_ACCESS_REMOTE_READ),
            ("dst", DST, session_pb2.REGION_ACCESS_REMOTE_WRITE),
            ("copy", COPY, session_pb2.REGION_ACCESS_REMOTE_READ),
        )
    ]
    await stubs.sessions.AdvertiseRegions(
        session_pb2.AdvertiseRegionsRequest(session=name, regions=regions)
    )


async def _copy(
    host: HostileHost, played: Played, job: int, answer: str, synced: bool, late: list[Frame]
) -> bool:
    """A COPY from the copy region; its READ answered as `answer` says. False: the
    agent is gone."""
    copy = wire.submit(
        job, wire.Kind.COPY, wire.Span(COPY[0], 4096, COPY[1]), wire.Span(DST[0], 4096, DST[1])
    )
    if not await host.send(wire.capsule_frame(copy)):
        return False
    read = await _drain_frames(host, played, 5 if synced else 0.001, want=COPY[1], synced=synced)
    assert read is not None or not synced, "the agent never READ for a copy"
    if read is not None and answer == "late":
        late.append(read)
    elif read is not None:
        await _answer(host, read, answer)
    return True

"""A tcp data-plane host written from docs/data-plane.md sections 1.3 and 3 alone.

It listens, sends its HELLO on every connection it accepts, keeps the one whose HELLO
carries the agent's token, and serves the agent's READs and WRITEs against memory it
names itself (`addr` and `rkey` are the host's names: here addresses it makes up, not
the virtual addresses of the bytearrays). For the suite it also records every frame
header the agent sent, can hold READs back for the test to answer (late, wrong, or
never), and keeps reading after it refused an access so a test can see what the agent
does next. Everything runs on the test's event loop; no `dpu_wire` import.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import itertools
import os
import secrets
import socket
from typing import TYPE_CHECKING

from dpu_wire.v1 import session_pb2
from tests.conformance import wire
from tests.conformance.wire import Frame, Ft

if TYPE_CHECKING:
    from collections.abc import Callable

READ = 1
WRITE = 2
_ADDRESSES = itertools.count(1)


@dataclasses.dataclass
class Region:
    """Host memory under the host's own names: `addr` and `rkey`."""

    addr: int
    rkey: int
    access: int  # READ | WRITE: what the agent may do
    data: bytearray

    @property
    def length(self) -> int:
        return len(self.data)

    @property
    def view(self) -> memoryview:
        return memoryview(self.data)

    def span(self, offset: int = 0, length: int | None = None) -> wire.Span:
        return wire.Span(
            self.addr + offset, self.length - offset if length is None else length, self.rkey
        )


class RawTcpHost:
    """One session's host side (see the module docstring)."""

    transport = "tcp"

    def __init__(self, bind: str = "127.0.0.1") -> None:
        self.listener = socket.create_server((bind, 0))
        self.listener.setblocking(False)
        self.bind = bind
        self.port = self.listener.getsockname()[1]
        self.token = secrets.token_bytes(wire.TOKEN_BYTES)
        self.accepted = 0  # connections the listener accepted
        self.sock: socket.socket | None = None
        self.agent_hello: bytes | None = None  # the agent's first frame, whole
        self.regions: dict[int, Region] = {}
        self.capsules: asyncio.Queue[bytes] = asyncio.Queue()
        self.frames: list[Frame] = []  # every frame header after the HELLOs
        self.hold_reads = False
        self.held: asyncio.Queue[Frame] = asyncio.Queue()
        self.hold_writes = False  # place WRITEs but leave them unanswered (held_writes)
        self.held_writes: list[Frame] = []
        self.refused: list[Frame] = []  # accesses this host refused
        self.after_refusal: list[Frame] = []  # what the agent sent after a refusal
        self.on_capsule: Callable[[bytes], None] | None = None  # at parse time (ordering)
        self.violations: list[str] = []
        self.eof = asyncio.Event()
        self._connected = asyncio.Event()
        self._acceptor: asyncio.Task[None] | None = None
        self._reader: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ set-up

    def endpoint(self, host: str | None = None, token: bytes | None = None) -> session_pb2.Endpoint:
        """The host_endpoint for OpenSession."""
        return session_pb2.Endpoint(
            tcp=session_pb2.TcpEndpoint(
                host=self.bind if host is None else host,
                port=self.port,
                token=self.token if token is None else token,
            )
        )

    def listen(self, *, hello: bytes | None = None, hello_delay: float = 0.0) -> None:
        """Accept connections from now on; send `hello` (default: ours) first on each.

        `hello_delay`: seconds to wait before sending it (a slow host; the agent waits 3).
        """
        self._acceptor = asyncio.get_running_loop().create_task(self._accept(hello, hello_delay))

    async def _accept(self, hello: bytes | None, hello_delay: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(self.listener)
            sock.setblocking(False)
            self.accepted += 1
            if self.sock is not None:
                sock.close()
                continue
            self.sock = sock
            await asyncio.sleep(hello_delay)
            await loop.sock_sendall(sock, wire.hello(self.token) if hello is None else hello)
            try:
                header = await self.recv_exactly(wire.FRAME.size)
                first = Frame(*wire.FRAME.unpack(header))
                payload = await self.recv_exactly(first.length) if first.type == Ft.HELLO else b""
                self.agent_hello = header + payload
            except EOFError:
                self.eof.set()
            self._connected.set()

    async def connected(self, agent_token: bytes, timeout: float = 10) -> None:  # noqa: ASYNC109
        """Wait for the agent's HELLO; check it carries `agent_token`; serve from then on."""
        await asyncio.wait_for(self._connected.wait(), timeout)
        hello = self.agent_hello
        assert hello is not None, "the agent closed the connection without a HELLO"
        first = Frame(*wire.FRAME.unpack_from(hello))
        assert first.type == Ft.HELLO, f"the agent's first frame is {first}"
        assert first.length == wire.TOKEN_BYTES, f"the agent's HELLO is {first}"
        assert hmac.compare_digest(hello[wire.FRAME.size :], agent_token), "wrong agent token"
        self._reader = asyncio.get_running_loop().create_task(self._serve())

    def region(
        self, length: int, access: int, *, addr: int | None = None, rkey: int | None = None
    ) -> Region:
        """Memory the agent may access, under names this host makes up."""
        while rkey is None or rkey in self.regions:
            rkey = secrets.randbits(32) or 1
        if addr is None:
            addr = next(_ADDRESSES) << 32  # a name, not where the bytes are
        made = Region(addr, rkey, access, bytearray(length))
        self.regions[rkey] = made
        return made

    def withdraw(self, region: Region) -> None:
        self.regions.pop(region.rkey, None)

    # ------------------------------------------------------------ the wire

    async def recv_exactly(self, n: int) -> bytes:
        assert self.sock is not None
        loop = asyncio.get_running_loop()
        data = bytearray()
        while len(data) < n:
            try:
                chunk = await loop.sock_recv(self.sock, n - len(data))
            except (ConnectionResetError, OSError) as exc:
                raise EOFError(str(exc)) from exc
            if not chunk:
                raise EOFError
            data += chunk
        return bytes(data)

    async def send(self, data: bytes) -> None:
        """Raw bytes on the connection."""
        assert self.sock is not None
        await asyncio.get_running_loop().sock_sendall(self.sock, data)

    async def send_capsules(self, capsules: list[bytes]) -> None:
        await self.send(b"".join(wire.capsule_frame(c) for c in capsules))

    def _lookup(self, f: Frame, need: int) -> memoryview | None:
        region = self.regions.get(f.rkey)
        if region is None or not region.access & need:
            return None
        offset = f.addr - region.addr
        if offset < 0 or offset + f.length > region.length:
            return None
        return region.view[offset : offset + f.length]

    async def answer_read(self, f: Frame, data: bytes | None = None, status: int = 0) -> None:
        """Answer a READ: from memory, with `data`, or refused (status 1)."""
        if data is None and status == 0:
            view = self._lookup(f, READ)
            if view is None:
                await self.refuse(f)
                return
            data = bytes(view)
        if status:
            await self.send(wire.frame(Ft.READ_RESP, status, f.req_id))
            return
        assert data is not None
        await self.send(wire.frame(Ft.READ_RESP, 0, f.req_id, length=len(data)) + data)

    async def refuse(self, f: Frame) -> None:
        """Status 1 for an access; this host then stops delivering what follows."""
        self.refused.append(f)
        answer = Ft.READ_RESP if f.type == Ft.READ else Ft.WRITE_ACK
        await self.send(wire.frame(answer, 1, f.req_id))

    async def _serve(self) -> None:
        try:
            while True:
                header = await self.recv_exactly(wire.FRAME.size)
                f = Frame(*wire.FRAME.unpack(header))
                payload = b""
                if f.type in (Ft.CAPSULE, Ft.WRITE, Ft.HELLO):
                    payload = await self.recv_exactly(f.length)
                if self.refused:  # after a refusal the data plane is over: observe only
                    self.after_refusal.append(f)
                    continue
                self.frames.append(f)
                await self._handle(f, payload)
        except EOFError:
            pass
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.violations.append(f"host failed: {exc!r}")
        finally:
            self.eof.set()

    async def _handle(self, f: Frame, payload: bytes) -> None:
        if f.type == Ft.CAPSULE:
            if self.on_capsule is not None:
                self.on_capsule(payload)
            self.capsules.put_nowait(payload)
        elif f.type == Ft.READ:
            if self.hold_reads:
                self.held.put_nowait(f)
            else:
                await self.answer_read(f)
        elif f.type == Ft.WRITE:
            view = self._lookup(f, WRITE)
            if view is None:
                await self.refuse(f)
            else:
                view[:] = payload
                if self.hold_writes:
                    self.held_writes.append(f)
                else:
                    await self.send(wire.frame(Ft.WRITE_ACK, 0, f.req_id))
        else:
            self.violations.append(f"the agent sent {f}")

    def stop_reading(self) -> None:
        """Read nothing more from the connection (and answer nothing), as a stuck host."""
        if self._reader is not None:
            self._reader.cancel()

    async def hang_up(self) -> None:
        """Close the connection as a host that goes away would (the reader sees EOF first:
        a socket closed under a pending loop read confuses the loop's selector)."""
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            if self._reader is not None:
                await asyncio.wait_for(self.eof.wait(), 5)
            self.sock.close()

    async def close(self) -> None:
        for task in (self._acceptor, self._reader):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self.sock is not None:
            self.sock.close()
        self.listener.close()


def random_bytes(n: int) -> bytes:
    return os.urandom(n)

"""The tcp transport: RC queue-pair semantics over one TCP connection.

The host side listens; the agent connects to the address the host sent in
OpenSession. Frames (little-endian), a 24-byte header and an optional payload:

    type u8 | status u8 | reserved u16 | req_id u32 | addr u64 | rkey u32 | length u32

    1 CAPSULE    either way    payload: the capsule (length bytes)
    2 READ       agent → host  read `length` bytes at (addr, rkey)
    3 READ_RESP  host → agent  status 0: payload is the bytes; else no payload
    4 WRITE      agent → host  payload: `length` bytes for (addr, rkey)
    5 WRITE_ACK  host → agent  status 0: placed; else refused

The host checks every READ and WRITE against its registered regions (rkey, bounds,
access) like an RDMA NIC; a refused access answers status 1 and the connection goes
on. Payloads go straight between sockets and region memory (recv_into), no
intermediate buffers on either side.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import secrets
import socket
import struct
from typing import TYPE_CHECKING, Final, NamedTuple

from dpu_wire.capsule import MAX_CAPSULE
from dpu_wire.transport import _memory
from dpu_wire.transport.base import (
    Access,
    AgentTransport,
    CapsuleInbox,
    HostTransport,
    PeerAddress,
    PeerClosed,
    Region,
    RemoteAccessError,
    TcpAddress,
    TransportError,
)

if TYPE_CHECKING:
    import mmap

log = logging.getLogger(__name__)

FRAME = struct.Struct("<BBHIQII")
STATUS_OK: Final = 0
STATUS_ACCESS: Final = 1
CONNECT_TIMEOUT: Final = 30.0


class _Type(enum.IntEnum):
    CAPSULE = 1
    READ = 2
    READ_RESP = 3
    WRITE = 4
    WRITE_ACK = 5


class _Frame(NamedTuple):
    kind: _Type
    status: int = 0
    req_id: int = 0
    addr: int = 0
    rkey: int = 0
    length: int = 0


class MemoryRegion(Region):
    """Anonymous memory with an address and a key."""

    def __init__(self, length: int, access: Access, rkey: int) -> None:
        self._mm: mmap.mmap | None
        self._mm, self.addr = _memory.allocate(length)
        self.view = memoryview(self._mm)[:length]
        self.length = length
        self.rkey = rkey
        self.access = access

    def close(self) -> None:
        """Unmap the memory; views a caller still holds keep it mapped until they go."""
        self.view.release()
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # a caller's view is alive: GC unmaps later
                self._mm.close()
            self._mm = None


class _FramedSocket:
    """Frame I/O on a non-blocking socket through the event loop."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._send_lock = asyncio.Lock()
        self._header = bytearray(FRAME.size)

    async def send(self, frame: _Frame, payload: memoryview | bytes | None = None) -> None:
        header = FRAME.pack(
            frame.kind, frame.status, 0, frame.req_id, frame.addr, frame.rkey, frame.length
        )
        try:
            async with self._send_lock:
                await self._loop.sock_sendall(self.sock, header)
                if payload is not None and len(payload):
                    await self._loop.sock_sendall(self.sock, payload)
        except OSError as exc:
            raise TransportError(f"tcp data plane send failed: {exc}") from exc

    async def recv_into(self, view: memoryview) -> None:
        """Fill `view` exactly, or raise TransportError if the peer closed."""
        got = 0
        while got < len(view):
            try:
                n = await self._loop.sock_recv_into(self.sock, view[got:])
            except ConnectionResetError as exc:
                raise PeerClosed(f"tcp data plane reset by the peer: {exc}") from exc
            except OSError as exc:
                raise TransportError(f"tcp data plane receive failed: {exc}") from exc
            if n == 0:
                raise PeerClosed("tcp data plane closed by the peer")
            got += n

    async def discard(self, length: int) -> None:
        """Read and drop `length` payload bytes."""
        scratch = memoryview(bytearray(min(length, 1 << 16) or 1))
        while length:
            chunk = min(length, len(scratch))
            await self.recv_into(scratch[:chunk])
            length -= chunk

    async def recv_header(self) -> _Frame:
        """The header of the next frame."""
        await self.recv_into(memoryview(self._header))
        kind, status, _reserved, req_id, addr, rkey, length = FRAME.unpack(self._header)
        if kind not in _Type._value2member_map_:
            raise TransportError(f"tcp data plane: unknown frame type {kind}")
        return _Frame(_Type(kind), status, req_id, addr, rkey, length)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


async def _recv_capsule(conn: _FramedSocket, length: int) -> bytes:
    if length > MAX_CAPSULE:
        raise TransportError(f"capsule of {length} bytes exceeds {MAX_CAPSULE}")
    buf = bytearray(length)
    await conn.recv_into(memoryview(buf))
    return bytes(buf)


class _Link:
    """What both sides share: the connection, the capsule queue and the reader task."""

    def __init__(self) -> None:
        self._conn: _FramedSocket | None = None
        self._inbox = CapsuleInbox()
        self._reader: asyncio.Task[None] | None = None
        self._closed = False

    async def send(self, capsule: bytes) -> None:
        """Send a capsule to the peer."""
        if self._conn is None or self._inbox.error is not None:
            raise self._inbox.error or TransportError("not connected")
        await self._conn.send(_Frame(_Type.CAPSULE, length=len(capsule)), capsule)

    async def recv(self) -> bytes:
        """The next capsule from the peer."""
        return await self._recv()

    async def _close_link(self) -> bool:
        """Fail the link, stop the reader, close the socket; False if already closed."""
        if self._closed:
            return False
        self._closed = True
        self._fail(TransportError("transport closed"))
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._conn is not None:
            self._conn.close()
        return True

    def _fail(self, error: TransportError) -> None:
        self._inbox.fail(error)

    async def _recv(self) -> bytes:
        if self._closed:
            raise TransportError("transport is closed")
        return await self._inbox.get()


class TcpHostTransport(_Link, HostTransport):
    """Host side: listens for the agent and serves its READ/WRITE on registered regions."""

    def __init__(self, bind_host: str = "127.0.0.1", advertise_host: str | None = None) -> None:
        _Link.__init__(self)
        self._listener = socket.create_server((bind_host, 0))
        self._listener.setblocking(False)
        port = self._listener.getsockname()[1]
        self._address = TcpAddress(advertise_host or bind_host, port)
        self._regions: dict[int, MemoryRegion] = {}

    @property
    def address(self) -> TcpAddress:
        """Where the agent connects."""
        return self._address

    async def connect(self, agent: PeerAddress | None) -> None:  # noqa: ARG002 - tcp: agent dials in
        """Accept the agent's connection (it dials in while answering OpenSession)."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                sock, _ = await loop.sock_accept(self._listener)
        except TimeoutError:
            raise TransportError(f"agent did not connect within {CONNECT_TIMEOUT} s") from None
        finally:
            self._listener.close()
        self._conn = _FramedSocket(sock)
        self._reader = asyncio.create_task(self._serve(self._conn), name="tcp-host-reader")

    def register(self, length: int, access: Access) -> MemoryRegion:
        """Allocate `length` bytes the agent may access as `access` allows."""
        rkey = secrets.randbits(32)
        while rkey in self._regions or rkey == 0:
            rkey = secrets.randbits(32)
        region = MemoryRegion(length, access, rkey)
        self._regions[rkey] = region
        return region

    def deregister(self, region: Region) -> None:
        """Forget the region; later accesses by the agent are refused."""
        mine = self._regions.pop(region.rkey, None)
        if mine is not None:
            mine.close()

    def _lookup(self, addr: int, rkey: int, length: int, need: Access) -> memoryview | None:
        region = self._regions.get(rkey)
        if region is None or not region.access & need:
            return None
        offset = addr - region.addr
        if offset < 0 or offset + length > region.length:
            return None
        return region.view[offset : offset + length]

    async def _serve(self, conn: _FramedSocket) -> None:
        try:
            while True:
                await self._handle(conn, await conn.recv_header())
        except TransportError as exc:
            self._fail(exc)

    async def _handle(self, conn: _FramedSocket, frame: _Frame) -> None:
        if frame.kind == _Type.CAPSULE:
            self._inbox.put(await _recv_capsule(conn, frame.length))
        elif frame.kind == _Type.READ:
            view = self._lookup(frame.addr, frame.rkey, frame.length, Access.REMOTE_READ)
            if view is None:
                await conn.send(_Frame(_Type.READ_RESP, STATUS_ACCESS, frame.req_id))
            else:
                await conn.send(
                    _Frame(_Type.READ_RESP, req_id=frame.req_id, length=len(view)), view
                )
        elif frame.kind == _Type.WRITE:
            view = self._lookup(frame.addr, frame.rkey, frame.length, Access.REMOTE_WRITE)
            if view is None:
                await conn.discard(frame.length)
                await conn.send(_Frame(_Type.WRITE_ACK, STATUS_ACCESS, frame.req_id))
            else:
                await conn.recv_into(view)
                await conn.send(_Frame(_Type.WRITE_ACK, req_id=frame.req_id))
        else:
            raise TransportError(f"unexpected frame {frame.kind.name} from the agent")

    async def close(self) -> None:
        """Close the connection and free every region."""
        if not await self._close_link():
            return
        self._listener.close()
        for region in self._regions.values():
            region.close()
        self._regions.clear()


class TcpAgentTransport(_Link, AgentTransport):
    """Agent side: dials the host and moves bytes with READ/WRITE frames."""

    def __init__(self) -> None:
        _Link.__init__(self)
        self._next_req = 1
        self._pending: dict[int, tuple[asyncio.Future[None], memoryview | None]] = {}

    @property
    def address(self) -> None:
        """Nothing: the host's side listens."""
        return

    async def connect(self, host: PeerAddress) -> None:
        """Dial the host's listener."""
        if not isinstance(host, TcpAddress):
            raise TransportError("the tcp transport needs a tcp host endpoint")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                infos = await loop.getaddrinfo(host.host, host.port, type=socket.SOCK_STREAM)
                family, socktype, proto, _, sockaddr = infos[0]
                sock = socket.socket(family, socktype, proto)
                sock.setblocking(False)
                try:
                    await loop.sock_connect(sock, sockaddr)
                except BaseException:
                    sock.close()
                    raise
        except (OSError, TimeoutError, ValueError) as exc:  # ValueError: a name IDNA refuses
            raise TransportError(
                f"cannot reach the host at {host.host}:{host.port}: {exc}"
            ) from exc
        self._conn = _FramedSocket(sock)
        self._reader = asyncio.create_task(self._serve(self._conn), name="tcp-agent-reader")

    def staging(self, length: int) -> MemoryRegion:
        """Local memory for READ destinations and WRITE sources."""
        return MemoryRegion(length, Access.NONE, 0)

    def release(self, region: Region) -> None:
        """Free a staging region."""
        if isinstance(region, MemoryRegion):
            region.close()

    def _request(self, into: memoryview | None) -> tuple[int, asyncio.Future[None]]:
        if self._conn is None or self._inbox.error is not None:
            raise self._inbox.error or TransportError("not connected")
        req_id = self._next_req
        self._next_req = (self._next_req + 1) & 0xFFFF_FFFF or 1
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending[req_id] = (future, into)
        return req_id, future

    async def read(self, local: Region, offset: int, length: int, addr: int, rkey: int) -> None:
        """RDMA READ from the host into local[offset:offset+length]."""
        req_id, future = self._request(local.view[offset : offset + length])
        assert self._conn is not None  # noqa: S101 - _request checked it
        await self._conn.send(_Frame(_Type.READ, 0, req_id, addr, rkey, length))
        await future

    async def write(self, local: Region, offset: int, length: int, addr: int, rkey: int) -> None:
        """RDMA WRITE local[offset:offset+length] to the host."""
        req_id, future = self._request(None)
        assert self._conn is not None  # noqa: S101
        payload = local.view[offset : offset + length]
        await self._conn.send(_Frame(_Type.WRITE, 0, req_id, addr, rkey, length), payload)
        await future

    async def _handle(self, conn: _FramedSocket, frame: _Frame) -> None:
        if frame.kind == _Type.CAPSULE:
            self._inbox.put(await _recv_capsule(conn, frame.length))
            return
        if frame.kind not in (_Type.READ_RESP, _Type.WRITE_ACK):
            raise TransportError(f"unexpected frame {frame.kind.name} from the host")
        future, into = self._pending.pop(frame.req_id, (None, None))
        if future is None:
            raise TransportError(f"answer to unknown request {frame.req_id}")
        if frame.status != STATUS_OK:
            future.set_exception(
                RemoteAccessError("host refused the access (rkey, bounds or permission)")
            )
            return
        if frame.kind == _Type.READ_RESP:
            if into is None or frame.length != len(into):
                raise TransportError("READ answer does not match the request")
            await conn.recv_into(into)
        if not future.done():
            future.set_result(None)

    async def _serve(self, conn: _FramedSocket) -> None:
        try:
            while True:
                await self._handle(conn, await conn.recv_header())
        except TransportError as exc:
            self._fail(exc)
            for future, _ in self._pending.values():
                if not future.done():
                    future.set_exception(exc)
            self._pending.clear()

    async def close(self) -> None:
        """Close the connection; pending reads and writes fail."""
        if not await self._close_link():
            return
        error = TransportError("transport closed")
        for future, _ in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()

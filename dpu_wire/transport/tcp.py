"""The tcp transport: RC queue-pair semantics over one TCP connection.

The host side listens; the agent connects to the address the host sent in
OpenSession, and the two sides prove to each other that the connection belongs to the
session before anything else crosses it (HELLO frames carrying the tokens exchanged
over the authenticated gRPC session, docs/data-plane.md section 1.3). Frames
(little-endian), a 24-byte header and an optional payload:

    type u8 | status u8 | reserved u16 | req_id u32 | addr u64 | rkey u32 | length u32

    1 CAPSULE    either way    payload: the capsule (length bytes)
    2 READ       agent → host  read `length` bytes at (addr, rkey)
    3 READ_RESP  host → agent  status 0: payload is the bytes; else no payload
    4 WRITE      agent → host  payload: `length` bytes for (addr, rkey)
    5 WRITE_ACK  host → agent  status 0: placed; else refused
    6 HELLO      either way    payload: the sender's 32-byte session token (first frame)

The host checks every READ and WRITE against its registered regions (rkey, bounds,
access) like an RDMA NIC; a refused access is answered with status 1 and then, as on
verbs where it moves both queue pairs to the error state, the session's data plane is
over on both sides. Payloads go straight between sockets and region memory (recv_into
the destination, sendmsg from the source), and frames are batched: many per system
call in each direction (`FrameStream`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import hmac
import logging
import secrets
import socket
import struct
import time
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from dpu_wire.capsule import MAX_CAPSULE, MAX_INLINE, SUBMIT_SIZE, Span
from dpu_wire.transport import _memory
from dpu_wire.transport.base import (
    Access,
    AgentLink,
    HostLink,
    OutCapsule,
    PeerAddress,
    PeerClosed,
    Region,
    RemoteAccessError,
    TcpAddress,
    TransportError,
    max_waiting,
    readable_view,
)

if TYPE_CHECKING:
    import mmap
    from collections.abc import Callable, Sequence

    from dpu_wire.transport.base import LinkSink

log = logging.getLogger(__name__)
# Every failure to reach the host says only this (data-plane.md DP-1.3-3).
HANDSHAKE_FAILED: Final = "the tcp connection or its HELLO exchange failed"

FRAME = struct.Struct("<BBHIQII")
STATUS_OK: Final = 0
STATUS_ACCESS: Final = 1
TOKEN_BYTES: Final = 32
CONNECT_TIMEOUT: Final = 5.0  # the agent's connect() to the host's listener
HELLO_TIMEOUT: Final = 3.0  # each side's wait for the other's HELLO (sent at once)
OP_TIMEOUT: Final = 30.0  # a READ or WRITE the host leaves unanswered this long fails the link
MAX_CANDIDATES: Final = 32  # connections a host checks at once (the oldest goes for a newer)
_RX_BUFFER: Final = 1 << 16
_IOV_MAX: Final = 512  # buffers per sendmsg (Linux IOV_MAX is 1024)
_SEND_CHUNK: Final = 1 << 22  # bytes per sendmsg: keeps one session from hogging the loop


class FrameType(enum.IntEnum):
    """The frame types (docs/data-plane.md section 3)."""

    CAPSULE = 1
    READ = 2
    READ_RESP = 3
    WRITE = 4
    WRITE_ACK = 5
    HELLO = 6


_TYPES: Final = frozenset(int(t) for t in FrameType)
_CAPSULE: Final = int(FrameType.CAPSULE)  # a plain int: compared once a frame


class Frame(NamedTuple):
    """A frame header."""

    kind: int
    status: int = 0
    req_id: int = 0
    addr: int = 0
    rkey: int = 0
    length: int = 0


def pack(  # noqa: PLR0913, PLR0917 - a frame header's fields, positional: hot path
    kind: int, status: int = 0, req_id: int = 0, addr: int = 0, rkey: int = 0, length: int = 0
) -> bytes:
    """A frame header."""
    return FRAME.pack(kind, status, 0, req_id, addr, rkey, length)


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


class FrameHandler:
    """What a `FrameStream` asks and tells about the frames it receives."""

    capsule_limit: int = MAX_CAPSULE  # the longest CAPSULE payload it takes

    def on_capsule_frame(self, payload: memoryview) -> None:
        """A whole CAPSULE frame, straight from the receive buffer (valid during the call).

        The stream calls this instead of `payload_target` and `on_frame` when the
        capsule's payload is already buffered, after checking it against
        `capsule_limit`; this default hands it to `on_frame`.
        """
        self.on_frame(Frame(FrameType.CAPSULE, length=len(payload)), payload)

    def payload_target(self, frame: Frame) -> memoryview | None:
        """Where the frame's payload goes (exactly `frame.length` bytes); None: discard it."""
        raise NotImplementedError

    def on_frame(self, frame: Frame, payload: memoryview | None) -> None:
        """A whole frame arrived (its payload, if any, is in the target)."""
        raise NotImplementedError


class FrameStream:
    """Frames over a non-blocking socket: batched receive and scatter-gather send.

    Receiving reads as much as the socket has into a buffer and parses the frames in it,
    as many as the caller's limit allows (the rest wait in the buffer, `pending`); a
    payload goes to the target the handler names, copied from the buffer or read into
    the target directly when it is large. Sending queues headers and payload
    views and writes them with `sendmsg`, many frames per call, keeping each frame's
    header and payload contiguous in the stream. Not thread-safe: one owner.
    """

    def __init__(self, sock: socket.socket, handler: FrameHandler) -> None:
        sock.setblocking(False)
        with contextlib.suppress(OSError):  # not a TCP socket in some tests
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._handler = handler
        self._rx = bytearray(_RX_BUFFER)
        self._rxv = memoryview(self._rx)
        self._start = 0  # parsed up to here
        self._end = 0  # received up to here
        self._frame: Frame | None = None  # header parsed, payload pending
        self._target: memoryview | None = None
        self._got = 0
        self._discard = 0  # payload bytes still to drop
        self._tx: collections.deque[memoryview] = collections.deque()
        self._tx_callbacks: collections.deque[tuple[int, Callable[[], None]]] = collections.deque()
        self._queued = 0  # bytes queued ever
        self._sent = 0  # bytes sent ever
        # since when queued bytes wait with the socket taking none (None: none wait)
        self.stuck_since: float | None = None
        self.closed = False

    # -- receive

    def receive(self, budget: int = 1 << 20, limit: int = 1 << 30) -> int:
        """Handle at most `limit` frames, reading about `budget` bytes at most; return how many.

        Frames received beyond `limit` stay in the buffer and are handled first by the
        next call, before it reads the socket again. The socket's readiness does not
        report them (their bytes left the kernel): a caller that passes a limit calls
        again while `pending` says so. A read shorter than the room offered means the
        socket is drained: it returns then, and the caller's level-triggered readiness
        wait reports what comes next. Raises PeerClosed at end of stream,
        TransportError on a socket error or a frame the handler refuses.
        """
        frames = self._parse(limit) if self.pending else 0
        received = 0
        while frames < limit and received < budget:
            # Here the buffer holds less than a frame header: `_parse` stops short of
            # its limit only then, or inside a payload that took every buffered byte.
            if self._target is not None and self._got < len(self._target) and not self._buffered:
                want = len(self._target) - self._got
                n = self._recv_into(self._target[self._got :])  # large payload: no copy
                if n is None:
                    return frames
                received += n
                self._got += n
                if self._got == len(self._target):
                    frames += self._finish_payload()
                if n < want:  # drained: the caller's readiness wait reports what comes next
                    return frames
                continue
            if self._start:  # move the piece of a header to the front (< 24 bytes)
                tail = self._end - self._start
                self._rx[:tail] = self._rx[self._start : self._end]
                self._start, self._end = 0, tail
            want = len(self._rx) - self._end
            n = self._recv_into(self._rxv[self._end :])
            if n is None:
                return frames
            received += n
            self._end += n
            frames += self._parse(limit - frames)
            if n < want:  # drained (saves a recv that fails with EAGAIN, and its exception)
                return frames
        return frames

    @property
    def pending(self) -> bool:
        """Whether received bytes wait that `receive` can handle without reading the socket.

        True only after a `receive` stopped at its limit: then the next one goes on from
        the buffer, and nothing else (the socket's readiness) says it should be called.
        """
        if self.closed:
            return False
        if self._target is not None or self._discard:
            return self._buffered > 0
        return self._buffered >= FRAME.size

    @property
    def _buffered(self) -> int:
        return self._end - self._start

    def _recv_into(self, view: memoryview) -> int | None:
        try:
            n = self.sock.recv_into(view)
        except (BlockingIOError, InterruptedError):
            return None
        except ConnectionResetError as exc:
            raise PeerClosed(f"tcp data plane reset by the peer: {exc}") from exc
        except OSError as exc:
            raise TransportError(f"tcp data plane receive failed: {exc}") from exc
        if n == 0:
            raise PeerClosed("tcp data plane closed by the peer")
        return n

    def _parse(self, limit: int) -> int:
        """Handle the frames in the buffer, `limit` at most; return how many finished."""
        frames = 0
        while frames < limit:
            if self._discard or self._target is not None:
                finished = self._feed_payload()
                if not finished:
                    return frames
                frames += finished
                continue
            if self._buffered < FRAME.size:
                return frames
            kind, status, _reserved, req_id, addr, rkey, length = FRAME.unpack_from(
                self._rx, self._start
            )
            start = self._start + FRAME.size
            self._start = start
            if kind == _CAPSULE and length <= self._end - start:
                # Whole in the buffer (most capsules): no copy into a target, one call.
                handler = self._handler
                if length > handler.capsule_limit:
                    raise TransportError(
                        f"capsule of {length} bytes exceeds {handler.capsule_limit}"
                    )
                self._start = start + length
                handler.on_capsule_frame(self._rxv[start : start + length])
                frames += 1
                continue
            frames += self._begin(Frame(kind, status, req_id, addr, rkey, length))
        return frames

    def _begin(self, frame: Frame) -> int:
        """Take a frame whose header is parsed: 1 if it is whole already, else 0.

        Every frame but a capsule whose payload is buffered comes here; a payload still
        to come goes into the handler's target (or is dropped).
        """
        if frame.kind not in _TYPES:
            raise TransportError(f"tcp data plane: unknown frame type {frame.kind}")
        if not self._has_payload(frame):
            self._handler.on_frame(frame, None)
            return 1
        target = self._handler.payload_target(frame)
        self._frame = frame
        length = frame.length
        if target is not None and len(target) != length:
            raise TransportError("tcp data plane: payload target of the wrong size")
        self._target, self._got, self._discard = target, 0, 0 if target is not None else length
        return 0 if length else self._finish_payload()

    def _feed_payload(self) -> int:
        """Move buffered bytes into the pending payload; 1 if it is now whole, else 0."""
        if self._target is None:
            drop = min(self._discard, self._buffered)
            self._start += drop
            self._discard -= drop
            return 0 if self._discard else self._finish_payload()
        take = min(len(self._target) - self._got, self._buffered)
        self._target[self._got : self._got + take] = self._rxv[self._start : self._start + take]
        self._start += take
        self._got += take
        if self._got < len(self._target):
            return 0  # the rest is read straight into the target
        return self._finish_payload()

    @staticmethod
    def _has_payload(frame: Frame) -> bool:
        if frame.kind in (FrameType.CAPSULE, FrameType.WRITE, FrameType.HELLO):
            return True
        return frame.kind == FrameType.READ_RESP and frame.status == STATUS_OK

    def _finish_payload(self) -> int:
        frame, target = self._frame, self._target
        assert frame is not None  # noqa: S101 - a payload belongs to a frame
        self._frame, self._target, self._got, self._discard = None, None, 0, 0
        self._handler.on_frame(frame, target)
        return 1

    # -- send

    def queue(
        self,
        header: bytes,
        payload: bytes | memoryview | None = None,
        sent: Callable[[], None] | None = None,
    ) -> None:
        """Queue a frame; `sent` is called once its last byte went to the kernel."""
        self._tx.append(memoryview(header))
        self._queued += len(header)
        if payload is not None and len(payload):
            view = memoryview(payload).cast("B")
            self._tx.append(view)
            self._queued += len(view)
        if sent is not None:
            self._tx_callbacks.append((self._queued, sent))

    def append(self, payload: memoryview) -> None:
        """Queue more payload for the frame queued last (its header counted it)."""
        if len(payload):
            view = payload.cast("B")
            self._tx.append(view)
            self._queued += len(view)

    @property
    def queued(self) -> int:
        """Bytes queued ever."""
        return self._queued

    @property
    def sent(self) -> int:
        """Bytes written to the socket ever."""
        return self._sent

    @property
    def wants_write(self) -> bool:
        """Whether bytes are queued."""
        return bool(self._tx)

    @property
    def waiting(self) -> int:
        """Buffers queued and not all sent: a frame is its header and its payload's."""
        return len(self._tx)

    def flush(self) -> bool:
        """Write what the socket takes now; True when nothing is left queued.

        Keeps `stuck_since`: when the socket last took bytes while more stayed queued,
        or first took none (None once nothing is queued).
        """
        tx = self._tx
        while tx:
            batch, size = self._next_batch()
            try:
                n = self.sock.sendmsg(batch)
            except (BlockingIOError, InterruptedError):
                if self.stuck_since is None:
                    self.stuck_since = time.monotonic()
                return False
            except OSError as exc:
                raise TransportError(f"tcp data plane send failed: {exc}") from exc
            self._sent += n
            if n == size and len(batch) == len(tx):
                tx.clear()
            else:
                self._drop_sent(n)
            callbacks = self._tx_callbacks
            while callbacks and callbacks[0][0] <= self._sent:
                callbacks.popleft()[1]()
            if n < size:  # the socket's buffer is full
                self.stuck_since = time.monotonic()
                return False
        self.stuck_since = None
        return True

    def _next_batch(self) -> tuple[list[memoryview], int]:
        """The queued buffers for one sendmsg, and their bytes."""
        tx = self._tx
        size = self._queued - self._sent  # the bytes tx holds
        if len(tx) <= _IOV_MAX and size <= _SEND_CHUNK:  # the usual case: all of it
            return list(tx), size
        batch: list[memoryview] = []
        size = 0
        for view in tx:
            batch.append(view)
            size += len(view)
            if len(batch) >= _IOV_MAX or size >= _SEND_CHUNK:
                break
        return batch, size

    def _drop_sent(self, n: int) -> None:
        """Take the first `n` bytes off the queue (a buffer may be cut)."""
        tx = self._tx
        while n:
            head = tx[0]
            if n >= len(head):
                n -= len(head)
                tx.popleft()
            else:
                tx[0] = head[n:]
                n = 0

    def drop_queued(self) -> None:
        """Forget the frames not sent yet; nothing more goes out of them."""
        self._tx.clear()
        self._tx_callbacks.clear()

    def close(self) -> None:
        """Close the socket; queued bytes are dropped."""
        if self.closed:
            return
        self.closed = True
        self.drop_queued()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


# ---------------------------------------------------------------- the handshake


def new_token() -> bytes:
    """A fresh session token for a HELLO."""
    return secrets.token_bytes(TOKEN_BYTES)


async def _read_hello(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes:
    """The token of the peer's first frame, which must be a HELLO; TransportError if not."""
    buf = bytearray(FRAME.size + TOKEN_BYTES)
    view = memoryview(buf)
    got = 0
    while got < FRAME.size:
        n = await loop.sock_recv_into(sock, view[got : FRAME.size])
        if n == 0:
            raise PeerClosed("closed before its HELLO")
        got += n
    kind, _status, _reserved, _req, _addr, _rkey, length = FRAME.unpack_from(buf)
    if kind != FrameType.HELLO or length != TOKEN_BYTES:
        raise TransportError("the first frame is not a HELLO with a session token")
    while got < len(buf):
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise PeerClosed("closed in its HELLO")
        got += n
    return bytes(buf[FRAME.size :])


def _check_token(token: bytes, expected: bytes) -> None:
    if not hmac.compare_digest(token, expected):
        raise TransportError("the peer did not present the session's token")


def _hello(token: bytes) -> bytes:
    return pack(FrameType.HELLO, length=len(token)) + token


async def dial(
    host: TcpAddress,
    *,
    address: tuple[int, int, int, Any] | None = None,
    connect_timeout: float = CONNECT_TIMEOUT,
    hello_timeout: float = HELLO_TIMEOUT,
) -> tuple[socket.socket, bytes]:
    """The agent's side of the handshake: connect, check the host's HELLO, send ours.

    `address` (family, type, proto, sockaddr) is where to connect when the caller has
    resolved and checked `host.host` already; None resolves it here.

    Nothing is sent to the listener before it proved, with the token the host gave in
    OpenSession, that it is the session's host. Returns the connected socket and the
    agent's token (sent in its HELLO, and returned to the host in OpenSession). Every
    failure raises TransportError with the same message: a caller learns nothing about
    the address it named (closed, filtered, or something else listening).
    """
    loop = asyncio.get_running_loop()
    sock: socket.socket | None = None
    try:
        async with asyncio.timeout(connect_timeout):
            if address is None:
                info = (await loop.getaddrinfo(host.host, host.port, type=socket.SOCK_STREAM))[0]
                address = (int(info[0]), int(info[1]), info[2], info[4])
            family, socktype, proto, sockaddr = address
            sock = socket.socket(family, socktype, proto)
            sock.setblocking(False)
            await loop.sock_connect(sock, sockaddr)
        async with asyncio.timeout(hello_timeout):
            _check_token(await _read_hello(loop, sock), host.token)
            mine = new_token()
            await loop.sock_sendall(sock, _hello(mine))
    except (OSError, TimeoutError, ValueError, TransportError) as exc:
        log.debug("tcp data plane handshake failed", extra={"error": repr(exc)})
        if sock is not None:
            sock.close()
        raise TransportError(HANDSHAKE_FAILED) from None
    except BaseException:
        if sock is not None:
            sock.close()
        raise
    return sock, mine


# ---------------------------------------------------------------- the agent side


class _Request(NamedTuple):
    kind: int  # FrameType.READ or FrameType.WRITE
    target: memoryview | None  # READ: where the answer goes
    token: int | None
    sent: float  # monotonic time it was queued
    end: int  # the stream's bytes queued ever with its frame: answerable once sent


def eager_flush(queue_depth: int) -> int:
    """Capsules the agent queues before it writes them out, not only at a pass's end.

    A quarter of the session's queue depth (at least 1): with `queue_depth` jobs in
    flight the host gets its completions in about four groups per round, so it can
    resubmit while the agent works on the rest, and a job costs at most 4/queue_depth
    `sendmsg` calls. Measured against a fixed 4 (three rounds each, 2026-11-27):
    crc32c jobs 4 KiB x8 168-188 MB/s at 4, 196-206 at 2, 185-192 at 1; 4 KiB reads
    at QD32 20.0-21.6k IOPS at 4, 21.4-23.1k at 8.
    """
    return max(1, queue_depth // 4)


class TcpAgentLink(AgentLink, FrameHandler):
    """Agent side: moves bytes with READ/WRITE frames; driven by the reactor.

    Made from the socket `dial` returned. An answer must match the type and id of an
    outstanding request (a READ_RESP answers a READ, a WRITE_ACK a WRITE, with the same
    req_id and, for a READ, the same length); anything else ends the link, and so does
    a refusal. A request unanswered for `op_timeout` seconds ends it too, and so does a
    request that would make more than `max_unanswered` unanswered at once (a host that
    submits jobs and answers none of their WRITEs would otherwise make the link keep a
    record of each until `op_timeout`), and so does a capsule queued behind more than
    `max_unanswered` frames that the socket has not taken (a host that sends SUBMITs and
    reads nothing would otherwise make it keep every COMPLETION), and so do frames that
    wait `op_timeout` seconds with the socket taking none of their bytes (a host that
    stops reading short of that bound would otherwise make it keep them for as long
    as the session lives). `max_unanswered` is
    `max_waiting(queue_depth)`; capsules go out every `eager_flush(queue_depth)`.
    """

    def __init__(
        self,
        sock: socket.socket,
        token: bytes,
        *,
        op_timeout: float = OP_TIMEOUT,
        inline_max: int = 0,
        queue_depth: int = 1,
    ) -> None:
        if not 0 <= inline_max <= MAX_INLINE:
            raise ValueError(f"inline_max must be 0..{MAX_INLINE}, not {inline_max}")
        self._stream = FrameStream(sock, self)
        self._token = token
        self._op_timeout = op_timeout
        self._next_req = 1
        self._requests: dict[int, _Request] = {}
        self._max_unanswered = max_waiting(queue_depth)
        self._eager_flush = eager_flush(queue_depth)
        self.inline_max = inline_max
        # one capsule at a time: the longest is an INLINE SUBMIT of inline_max bytes
        self._capsule = bytearray(max(MAX_CAPSULE, SUBMIT_SIZE + inline_max))
        self.capsule_limit = len(self._capsule)
        self._sink: LinkSink | None = None
        self._done: list[int] = []  # tokens finished by sends, reported at the next poll
        self._capsules = 0  # CAPSULE frames queued since the last flush
        self.error = None

    @property
    def address(self) -> TcpAddress:
        """The agent's token, for the host to check against its HELLO."""
        return TcpAddress("", 0, self._token)

    def staging(self, length: int) -> MemoryRegion:
        """Local memory for READ destinations and WRITE sources."""
        return MemoryRegion(length, Access.NONE, 0)

    def release(self, region: Region) -> None:
        """Free a staging region."""
        if isinstance(region, MemoryRegion):
            region.close()

    def fileno(self) -> int:
        """The socket."""
        return self._stream.sock.fileno()

    def on_event(self) -> None:
        """Nothing to consume: `poll` reads the socket."""

    @property
    def outstanding(self) -> int:
        """READ and WRITE requests not answered yet."""
        return len(self._requests)

    @property
    def wants_write(self) -> bool:
        """Frames wait for the socket."""
        return self._stream.wants_write

    def room(self) -> int:
        """Always room: the socket buffers and TCP flow control pace the sender."""
        return 1 << 30

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def _request(self, kind: int, target: memoryview | None, token: int | None, size: int) -> int:
        """A request id for a frame of `size` bytes the caller queues next."""
        req_id = self._next_req
        self._next_req = (req_id + 1) & 0xFFFF_FFFF or 1
        if len(self._requests) >= self._max_unanswered:
            raise self._fail(
                TransportError(
                    f"the host left {len(self._requests)} READ and WRITE requests unanswered, "
                    "the most a link may have"
                )
            )
        if req_id in self._requests:  # 2**32 requests behind: the host stopped answering
            raise self._fail(TransportError("request ids wrapped onto an unanswered request"))
        end = self._stream.queued + size
        self._requests[req_id] = _Request(kind, target, token, time.monotonic(), end)
        return req_id

    def post_read(  # noqa: PLR0913, PLR0917 - an RDMA READ's operands
        self, local: Region, offset: int, length: int, addr: int, rkey: int, token: int
    ) -> None:
        """Queue a READ frame; the answer lands in `local[offset:offset+length]`."""
        self._check()
        target = local.view[offset : offset + length]
        req_id = self._request(FrameType.READ, target, token, FRAME.size)
        self._stream.queue(pack(FrameType.READ, 0, req_id, addr, rkey, length))

    def post_write(  # noqa: PLR0913, PLR0917 - an RDMA WRITE's operands
        self, local: Region, offset: int, length: int, addr: int, rkey: int, token: int | None
    ) -> None:
        """Queue a WRITE frame with its payload (sent from `local` without a copy)."""
        self._check()
        req_id = self._request(FrameType.WRITE, None, token, FRAME.size + length)
        header = pack(FrameType.WRITE, 0, req_id, addr, rkey, length)
        self._stream.queue(header, local.view[offset : offset + length])

    def post_send(self, capsule: bytes, token: int | None = None) -> None:
        """Queue a CAPSULE frame; `token` is done once it (and what came before) is sent."""
        self._check()
        if len(capsule) > MAX_CAPSULE:
            raise ValueError(f"capsule of {len(capsule)} bytes exceeds {MAX_CAPSULE}")
        if self._stream.waiting > 2 * self._max_unanswered:  # two buffers a frame
            raise self._fail(
                TransportError(
                    f"the host does not read: more than {self._max_unanswered} frames "
                    "wait to be sent, the most a link may hold"
                )
            )
        sent = None if token is None else (lambda: self._done.append(token))
        self._stream.queue(pack(FrameType.CAPSULE, length=len(capsule)), capsule, sent)
        self._capsules += 1
        if self._capsules >= self._eager_flush:
            self.flush()

    def flush(self) -> None:
        """Write the queued frames the socket takes now."""
        self._capsules = 0
        if self.error is not None:
            return
        try:
            self._stream.flush()
        except TransportError as exc:
            self._fail(exc)

    @property
    def backlog(self) -> bool:
        """Frames received and not handled yet (`poll` took its budget): poll again."""
        return self.error is None and self._stream.pending

    def poll(self, sink: LinkSink, budget: int) -> int:
        """Handle up to `budget` frames; report finished sends and failures.

        One read of the socket may bring many more frames than that (64 KiB of them);
        those wait in the stream's buffer for the next polls (`backlog`).
        """
        taken = 0
        if self.error is None:
            self._sink = sink
            try:
                taken = self._stream.receive(budget * MAX_CAPSULE, budget)
            except TransportError as exc:
                self._fail(exc)
            finally:
                self._sink = None
        done, self._done = self._done, []
        for token in done:
            sink.on_done(token, self.error)
        if self.error is not None and self._requests:
            failed, self._requests = self._requests, {}
            for request in failed.values():
                if request.token is not None:
                    sink.on_done(request.token, self.error)
        return taken + len(done)

    def payload_target(self, frame: Frame) -> memoryview | None:
        """FrameHandler: capsules into a small buffer, READ answers into the staging memory."""
        if frame.kind == FrameType.CAPSULE:
            if frame.length > self.capsule_limit:
                raise TransportError(
                    f"capsule of {frame.length} bytes exceeds {self.capsule_limit}"
                )
            return memoryview(self._capsule)[: frame.length]
        if frame.kind == FrameType.READ_RESP:
            request = self._answered(frame, FrameType.READ)
            if request.target is None or frame.length != len(request.target):
                raise TransportError("a READ_RESP does not match its READ's length")
            return request.target
        raise TransportError(f"unexpected frame {FrameType(frame.kind).name} from the host")

    def on_capsule_frame(self, payload: memoryview) -> None:
        """FrameHandler: hand the capsule over."""
        sink = self._sink
        assert sink is not None  # noqa: S101 - only inside poll()
        sink.on_capsule(payload)

    def on_frame(self, frame: Frame, payload: memoryview | None) -> None:
        """FrameHandler: hand capsules over; finish answered requests."""
        sink = self._sink
        assert sink is not None  # noqa: S101 - only inside poll()
        if frame.kind == FrameType.CAPSULE:
            assert payload is not None  # noqa: S101 - capsules have a target
            sink.on_capsule(payload)
            return
        if frame.kind not in (FrameType.READ_RESP, FrameType.WRITE_ACK):
            raise TransportError(f"unexpected frame {FrameType(frame.kind).name} from the host")
        kind = FrameType.READ if frame.kind == FrameType.READ_RESP else FrameType.WRITE
        request = self._answered(frame, kind)
        if frame.status != STATUS_OK:  # the request stays: the failure reports its token
            raise RemoteAccessError(
                f"the host refused a {kind.name} (rkey, bounds or access): the data plane is over"
            )
        del self._requests[frame.req_id]
        if request.token is not None:
            sink.on_done(request.token, None)

    def _answered(self, frame: Frame, kind: FrameType) -> _Request:
        request = self._requests.get(frame.req_id)
        # one whose frame has not all left yet is not outstanding (DP-3-3)
        if request is None or request.kind != kind or request.end > self._stream.sent:
            raise TransportError(
                f"a {FrameType(frame.kind).name} answers no outstanding {kind.name} "
                f"(req_id {frame.req_id})"
            )
        return request

    def arm(self, sink: LinkSink) -> bool:
        """Ready to sleep (the socket's readiness wakes the reactor) once sends are reported.

        A send's token is done when its bytes went to the kernel, which `flush` finds
        after the pass's poll: those are reported here, and the link stays awake for
        one more pass so its owner can act on them.
        """
        if not self._done:
            return True
        done, self._done = self._done, []
        for token in done:
            sink.on_done(token, self.error)
        return False

    def overdue(self, now: float) -> bool:
        """Whether something waited longer than the link's limit (then it fails).

        That is the oldest unanswered request (DP-3-7), or queued frames while the
        socket took none of their bytes (DP-3-11).
        """
        if self.error is not None:
            return False
        stuck = self._stream.stuck_since
        if stuck is not None and now - stuck > self._op_timeout:
            self._fail(
                TransportError(
                    f"the host read nothing for {self._op_timeout:g} s: "
                    f"{self._stream.waiting} buffers wait to be sent"
                )
            )
            return True
        if not self._requests:
            return False
        oldest = next(iter(self._requests.values())).sent
        if now - oldest <= self._op_timeout:
            return False
        self._fail(
            TransportError(f"the host left a READ or WRITE unanswered for {self._op_timeout:g} s")
        )
        return True

    def _fail(self, error: TransportError) -> TransportError:
        """Fail the link: nothing more is read or sent, and `close` closes the socket.

        The socket stays open until the owner, told of the failure, closes the link: the
        host must not see the connection end before the session is FAILED (DP-4-6).
        """
        if self.error is None:
            self.error = error.detached()
            log.warning("tcp data plane failed: %s", error)
            self._stream.drop_queued()
        return self.error

    def close(self) -> None:
        """Close the socket. Idempotent; reports nothing."""
        if self.error is None:
            self.error = TransportError("transport closed")
        self._requests.clear()
        self._stream.close()


# ---------------------------------------------------------------- the host side


class TcpHostLink(HostLink, FrameHandler):
    """Host side: listens for the agent and serves its READ/WRITE on registered regions.

    The listener is open from construction: connections are accepted at once (while
    OpenSession is in flight), each is sent the host's HELLO, and `connect` keeps the
    one whose HELLO carries the agent's token from OpenSession.
    """

    def __init__(self, bind_host: str = "127.0.0.1", advertise_host: str | None = None) -> None:
        self._listener = socket.create_server((bind_host, 0))
        self._listener.setblocking(False)
        port = self._listener.getsockname()[1]
        self._token = new_token()
        self._address = TcpAddress(advertise_host or bind_host, port, self._token)
        self._regions: dict[int, MemoryRegion] = {}
        self._stream: FrameStream | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._acceptor: asyncio.Task[None] | None = None
        # accepted connections being checked, oldest first, and the HELLOs they sent
        self._held: dict[socket.socket, asyncio.Task[None]] = {}
        self._hellos: dict[socket.socket, bytes] = {}
        self._hello_arrived = asyncio.Event()
        self._capsule = bytearray(MAX_CAPSULE)
        self._on_capsule: Callable[[memoryview], None] | None = None
        self._on_failure: Callable[[TransportError], None] | None = None
        self._writing = False
        self._corked = False  # a flush is due at the loop's next turn (see send)
        self._delivered = False  # this receive handed a capsule over (see _readable)
        self.reads_served = 0  # the agent's READs answered with data (inline sources need none)
        self.error: TransportError | None = None
        self._closed = False

    @property
    def address(self) -> TcpAddress:
        """Where the agent connects, and the token this side presents."""
        return self._address

    def _start_accepting(self) -> None:
        if self._acceptor is None:
            self._loop = asyncio.get_running_loop()
            self._acceptor = self._loop.create_task(self._accept(), name="tcp-host-accept")

    async def _accept(self) -> None:
        """Check every connection at once: a silent one must not hold up the agent's.

        Another local process can connect first and say nothing; with `MAX_CANDIDATES`
        held, the oldest is dropped for the newest, so only a flood faster than the
        agent's HELLO could push the agent's connection out.
        """
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(self._listener)
            sock.setblocking(False)
            if len(self._held) >= MAX_CANDIDATES:
                self._drop(next(iter(self._held)))
            self._held[sock] = loop.create_task(self._check(sock), name="tcp-host-hello")

    async def _check(self, sock: socket.socket) -> None:
        """Send the host's HELLO and take the peer's (judged in `connect`)."""
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_sendall(sock, _hello(self._token))
            async with asyncio.timeout(HELLO_TIMEOUT):
                self._hellos[sock] = await _read_hello(loop, sock)
        except (OSError, TimeoutError, TransportError):
            self._drop(sock)
            return
        self._hello_arrived.set()

    def _drop(self, sock: socket.socket) -> None:
        task = self._held.pop(sock, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        self._hellos.pop(sock, None)
        sock.close()

    def _agents(self, token: bytes) -> socket.socket | None:
        """The connection whose HELLO carries `token`; the others that sent one are closed."""
        for sock, hello in list(self._hellos.items()):
            if hmac.compare_digest(hello, token):
                del self._hellos[sock]
                del self._held[sock]
                return sock
            self._drop(sock)
        return None

    def listen(self) -> None:
        """Start accepting connections (call before OpenSession, on the session's loop)."""
        self._start_accepting()

    async def connect(self, agent: PeerAddress | None) -> None:
        """Keep the connection whose HELLO carries the agent's token; close the others."""
        if not isinstance(agent, TcpAddress) or len(agent.token) != TOKEN_BYTES:
            raise TransportError("the agent's answer carries no tcp session token")
        self._start_accepting()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT + HELLO_TIMEOUT):
                while (sock := self._agents(agent.token)) is None:
                    self._hello_arrived.clear()
                    await self._hello_arrived.wait()
        except TimeoutError:
            raise TransportError("the agent did not connect with the session's token") from None
        finally:
            self._stop_accepting()
        self._stream = FrameStream(sock, self)

    def _stop_accepting(self) -> None:
        if self._acceptor is not None:
            self._acceptor.cancel()
        self._listener.close()
        for sock in list(self._held):
            self._drop(sock)

    def register(self, length: int, access: Access) -> MemoryRegion:
        """Allocate `length` bytes the agent may access as `access` allows."""
        rkey = secrets.randbits(32)
        while rkey in self._regions or rkey == 0:
            rkey = secrets.randbits(32)
        region = MemoryRegion(length, access, rkey)
        self._regions[rkey] = region
        return region

    def deregister(self, region: Region) -> None:
        """Forget the region; later accesses by the agent are refused (and end the link)."""
        mine = self._regions.pop(region.rkey, None)
        if mine is not None:
            mine.close()

    def start(
        self,
        on_capsule: Callable[[memoryview], None],
        on_failure: Callable[[TransportError], None],
        expecting: Callable[[], bool],  # noqa: ARG002 - the socket wakes this side
    ) -> None:
        """Serve the agent's frames on this loop from now on."""
        if self._stream is None:
            raise TransportError("not connected")
        self._loop = asyncio.get_running_loop()
        self._on_capsule, self._on_failure = on_capsule, on_failure
        self._loop.add_reader(self._stream.sock.fileno(), self._readable)

    def send(self, capsules: Sequence[OutCapsule]) -> None:
        """Queue CAPSULE frames and write what the socket takes now.

        An INLINE SUBMIT's source goes out from its region's memory, no copy made.
        """
        if self.error is not None:
            raise self.error
        stream = self._stream
        if stream is None:
            raise TransportError("not connected")
        for capsule in capsules:
            if isinstance(capsule, tuple):
                submit, source = capsule
                stream.queue(pack(FrameType.CAPSULE, length=len(submit) + len(source)), submit)
                stream.append(source)
                continue
            if len(capsule) > MAX_CAPSULE:
                raise ValueError(f"capsule of {len(capsule)} bytes exceeds {MAX_CAPSULE}")
            stream.queue(pack(FrameType.CAPSULE, length=len(capsule)), capsule)
        if self._corked:
            return  # the loop's next turn writes these with the others sent meanwhile
        self._flush()
        # Capsules sent later in this turn of the loop (by the other tasks a batch of
        # COMPLETIONs woke, say) go out together at the start of the next one: one
        # sendmsg for the burst instead of one each, and the first goes out at once.
        self._cork()

    def _cork(self) -> None:
        """Flush at the loop's next turn, with whatever is queued meanwhile."""
        self._corked = True
        assert self._loop is not None  # noqa: S101 - started
        self._loop.call_soon(self._uncork)

    def _uncork(self) -> None:
        self._corked = False
        self._flush()

    def local_view(self, span: Span) -> memoryview | None:
        """The memory behind `span` if it lies in a region the agent may READ."""
        return readable_view(self._regions.get(span[2]), span)

    def _readable(self) -> None:
        stream = self._stream
        if stream is None or self.error is not None:
            return
        self._delivered = False
        reads = self.reads_served
        try:
            stream.receive()
        except TransportError as exc:
            self._fail(exc)
            return
        if self.reads_served != reads or not self._delivered:
            self._flush()  # the agent waits on READ answers: at once
        elif not self._corked:
            # Only WRITE_ACKs to send, and a capsule (a COMPLETION) was handed over: the
            # task it wakes runs in this turn of the loop and often sends (its next
            # SUBMIT). The acks go with that, in one sendmsg, at the next turn.
            self._cork()

    def _flush(self) -> None:
        stream = self._stream
        if stream is None or self.error is not None:
            return
        try:
            done = stream.flush()
        except TransportError as exc:
            self._fail(exc)
            return
        assert self._loop is not None  # noqa: S101 - started
        if not done and not self._writing:
            self._writing = True
            self._loop.add_writer(stream.sock.fileno(), self._writable)
        elif done and self._writing:
            self._writing = False
            self._loop.remove_writer(stream.sock.fileno())

    def _writable(self) -> None:
        self._flush()

    def _lookup(self, frame: Frame, need: Access) -> memoryview | None:
        region = self._regions.get(frame.rkey)
        if region is None or not region.access.value & need.value:  # IntFlag's & costs 1 us
            return None
        offset = frame.addr - region.addr
        if offset < 0 or offset + frame.length > region.length:
            return None
        return region.view[offset : offset + frame.length]

    def payload_target(self, frame: Frame) -> memoryview | None:
        """FrameHandler: capsules into a small buffer, WRITEs straight into the region."""
        if frame.kind == FrameType.CAPSULE:
            if frame.length > self.capsule_limit:
                raise TransportError(
                    f"capsule of {frame.length} bytes exceeds {self.capsule_limit}"
                )
            return memoryview(self._capsule)[: frame.length]
        if frame.kind == FrameType.WRITE:
            return self._lookup(frame, Access.REMOTE_WRITE)  # None: refused, dropped
        raise TransportError(f"unexpected frame {FrameType(frame.kind).name} from the agent")

    def on_capsule_frame(self, payload: memoryview) -> None:
        """FrameHandler: hand the capsule over."""
        self._delivered = True
        if self._on_capsule is not None:
            self._on_capsule(payload)

    def on_frame(self, frame: Frame, payload: memoryview | None) -> None:
        """FrameHandler: serve READs and WRITEs, hand capsules over."""
        stream = self._stream
        assert stream is not None  # noqa: S101 - frames come from the stream
        if frame.kind == FrameType.CAPSULE:
            assert payload is not None  # noqa: S101
            self.on_capsule_frame(payload)
        elif frame.kind == FrameType.READ:
            view = self._lookup(frame, Access.REMOTE_READ)
            if view is None:
                self._refuse(FrameType.READ_RESP, frame)
            else:
                self.reads_served += 1
                stream.queue(pack(FrameType.READ_RESP, 0, frame.req_id, length=len(view)), view)
        elif frame.kind == FrameType.WRITE:
            if payload is None:
                self._refuse(FrameType.WRITE_ACK, frame)
            else:
                stream.queue(pack(FrameType.WRITE_ACK, 0, frame.req_id))
        else:
            raise TransportError(f"unexpected frame {FrameType(frame.kind).name} from the agent")

    def _refuse(self, answer: FrameType, frame: Frame) -> None:
        """Answer a refused access with status 1; then the data plane is over (as on verbs)."""
        assert self._stream is not None  # noqa: S101
        self._stream.queue(pack(answer, STATUS_ACCESS, frame.req_id))
        with contextlib.suppress(TransportError):
            self._stream.flush()
        what = "READ" if frame.kind == FrameType.READ else "WRITE"
        raise RemoteAccessError(
            f"the agent made a {what} this host refused (rkey {frame.rkey:#x}, "
            f"{frame.length} bytes at {frame.addr:#x}): the data plane is over"
        )

    def _fail(self, error: TransportError) -> None:
        if self.error is not None:
            return
        self.error = error.detached()
        if self._stream is not None and self._loop is not None:
            fd = self._stream.sock.fileno()
            if fd >= 0:
                self._loop.remove_reader(fd)
                self._loop.remove_writer(fd)
            self._stream.close()
        if not self._closed and self._on_failure is not None:
            self._on_failure(error)

    async def close(self) -> None:
        """Close the connection and free every region. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._acceptor is not None or self._listener.fileno() >= 0:
            self._stop_accepting()
        if self._acceptor is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._acceptor
        self._fail(TransportError("transport closed"))
        for region in self._regions.values():
            region.close()
        self._regions.clear()

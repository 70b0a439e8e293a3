"""The data-plane transport interface: one session's byte mover, on either side.

A transport gives each side of a session the operations of an RDMA RC queue pair:

- the host registers memory regions (`HostTransport.register`) and advertises their
  (addr, length, rkey, access) to the agent over gRPC;
- either side sends capsules (`send`) and receives them in order (`recv`): a SEND
  consumed by a posted RECV on verbs, one frame on tcp;
- the agent moves bytes with one-sided operations against the host's regions:
  `read` (RDMA READ host → DPU staging buffer) and `write` (RDMA WRITE DPU → host),
  without the host's program doing anything.

Ordering: a `write` that completed before a `send` is visible in host memory before
the host receives that capsule (RC ordering; the tcp transport keeps it by using one
ordered stream and acknowledging every write).

Two implementations with the same semantics: `verbs` (pyverbs, any RDMA device) and
`tcp` (a socket; the host side serves the agent's READ/WRITE against its registered
regions, checking rkey, bounds and access, as an RDMA NIC does).
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import enum
from typing import TYPE_CHECKING, Self

if TYPE_CHECKING:
    from types import TracebackType


class Access(enum.IntFlag):
    """What the peer may do to a registered region."""

    NONE = 0
    REMOTE_READ = 1  # the agent may READ it (job input)
    REMOTE_WRITE = 2  # the agent may WRITE it (job output)


class TransportError(Exception):
    """The data plane failed; the session cannot continue (QP in error, peer gone)."""


class PeerClosed(TransportError):
    """The peer closed its end of the link (its process exited, or it closed the link)."""


class RemoteAccessError(TransportError):
    """The peer refused a READ or WRITE: bad rkey, out of bounds or access not granted."""


@dataclasses.dataclass(frozen=True)
class VerbsAddress:
    """Where to reach one side's RC queue pair."""

    gid: bytes  # 16 bytes
    qp_num: int
    psn: int
    mtu: int  # bytes
    lid: int = 0


@dataclasses.dataclass(frozen=True)
class TcpAddress:
    """Where to reach the host side's tcp data-plane listener."""

    host: str
    port: int


PeerAddress = VerbsAddress | TcpAddress


class Region(abc.ABC):
    """Registered memory: `view` is the bytes, (`addr`, `rkey`) how the peer names them."""

    view: memoryview
    addr: int
    length: int
    rkey: int
    access: Access


class _Closeable(abc.ABC):
    @abc.abstractmethod
    async def close(self) -> None:
        """Release everything; pending operations fail with TransportError. Idempotent."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class CapsuleLink(_Closeable):
    """Ordered capsule exchange, the part both sides share."""

    @abc.abstractmethod
    async def send(self, capsule: bytes) -> None:
        """Send one capsule (at most `dpu_wire.capsule.MAX_CAPSULE` bytes)."""

    @abc.abstractmethod
    async def recv(self) -> bytes:
        """The next capsule from the peer; TransportError when the link is gone."""


class HostTransport(CapsuleLink):
    """The host side of a session's data plane."""

    @property
    @abc.abstractmethod
    def address(self) -> PeerAddress:
        """This side's address, sent to the agent in OpenSession."""

    @abc.abstractmethod
    async def connect(self, agent: PeerAddress | None) -> None:
        """Complete the connection once the agent answered OpenSession."""

    @abc.abstractmethod
    def register(self, length: int, access: Access) -> Region:
        """Allocate and register `length` bytes the agent may access as `access` allows."""

    @abc.abstractmethod
    def deregister(self, region: Region) -> None:
        """Withdraw a region: the agent's later accesses to it fail."""


class AgentTransport(CapsuleLink):
    """The agent side of a session's data plane."""

    @property
    @abc.abstractmethod
    def address(self) -> PeerAddress | None:
        """This side's address, returned to the host (None: nothing to return)."""

    @abc.abstractmethod
    async def connect(self, host: PeerAddress) -> None:
        """Connect to the host side whose address came in OpenSession."""

    @abc.abstractmethod
    def staging(self, length: int) -> Region:
        """DPU memory usable as READ destination and WRITE source (local only)."""

    @abc.abstractmethod
    def release(self, region: Region) -> None:
        """Return a staging region."""

    @abc.abstractmethod
    async def read(self, local: Region, offset: int, length: int, addr: int, rkey: int) -> None:
        """RDMA READ `length` bytes at host (`addr`, `rkey`) into `local[offset:]`."""

    @abc.abstractmethod
    async def write(self, local: Region, offset: int, length: int, addr: int, rkey: int) -> None:
        """RDMA WRITE `local[offset:offset+length]` to host (`addr`, `rkey`)."""


class CapsuleInbox:
    """Received capsules in order; once failed, every later `get` raises the same error."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[bytes | TransportError] = asyncio.Queue()
        self.error: TransportError | None = None

    def put(self, capsule: bytes) -> None:
        """Deliver a capsule."""
        self._queue.put_nowait(capsule)

    def fail(self, error: TransportError) -> bool:
        """Record the link's failure once; False if it had already failed."""
        if self.error is not None:
            return False
        self.error = error
        self._queue.put_nowait(error)
        return True

    async def get(self) -> bytes:
        """The next capsule, or the link's TransportError."""
        item = await self._queue.get()
        if isinstance(item, TransportError):
            self._queue.put_nowait(item)  # every later get fails the same way
            raise item
        return item

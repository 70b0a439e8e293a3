"""The data-plane transport interface: one session's byte mover, on either side.

A transport gives each side of a session the operations of an RDMA RC queue pair:

- the host registers memory regions (`HostLink.register`) and advertises their
  (addr, length, rkey, access) to the agent over gRPC;
- either side sends capsules and receives them in order: a SEND consumed by a posted
  RECV on verbs, one CAPSULE frame on tcp;
- the agent moves bytes with one-sided operations against the host's regions:
  `post_read` (RDMA READ host → DPU staging buffer) and `post_write` (RDMA WRITE
  DPU → host), without the host's program doing anything.

Ordering: an operation posted before a SEND is finished at the host before the host
receives that capsule (RC ordering on verbs; one ordered stream on tcp).

The two sides are driven differently:

- `AgentLink` is driven by the agent's data-plane reactor (one thread, no asyncio):
  the reactor posts operations (`post_read`, `post_write`, `post_send`), pushes them
  out (`flush`), and calls `poll` to take completions and received capsules, which the
  link hands to a `LinkSink`. When a link has nothing outstanding the reactor may
  `arm` it and wait on `fileno()` with every other link's descriptor. Every method is
  called from the reactor thread only (set-up and `close` excepted, before and after).
- `HostLink` is the SDK's side, on the host program's asyncio loop: it registers
  memory, sends capsules (`send`, never blocking) and calls back for each capsule
  received; it serves the agent's READs and WRITEs by itself (the NIC on verbs, the
  link's protocol handler on tcp).

Two implementations with the same semantics: `verbs` (pyverbs, any RDMA device) and
`tcp` (a socket; the host side serves the agent's READ/WRITE against its registered
regions, checking rkey, bounds and access, as an RDMA NIC does).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from typing import TYPE_CHECKING, Final, Protocol, Self

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from types import TracebackType

    from dpu_wire.capsule import CompletionFields, Span


OutCapsule = bytes | tuple[bytes, memoryview]
"""What a host link sends: a capsule, or an INLINE SUBMIT and its source's bytes."""


class Access(enum.IntFlag):
    """What the peer may do to a registered region."""

    NONE = 0
    REMOTE_READ = 1  # the agent may READ it (job input)
    REMOTE_WRITE = 2  # the agent may WRITE it (job output)


_REMOTE_READ: Final = Access.REMOTE_READ.value


class TransportError(Exception):
    """The data plane failed; the session cannot continue (QP in error, peer gone)."""

    def detached(self) -> Self:
        """This error without tracebacks (its own, its cause's and context's), to keep.

        A link keeps its error as long as it lives; a traceback would keep its frames,
        and through them whatever they referred to (buffers, other sessions), as long.
        """
        seen: set[int] = set()
        error: BaseException | None = self
        while error is not None and id(error) not in seen:
            seen.add(id(error))
            error.__traceback__ = None
            error = error.__cause__ or error.__context__
        return self


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
    """Where to reach the host side's tcp listener, and the token its side presents.

    The host's address carries the listener (`host`, `port`) and the host's token;
    the agent's carries only the agent's token (see docs/data-plane.md section 1.3).
    """

    host: str
    port: int
    token: bytes = dataclasses.field(default=b"", repr=False)


PeerAddress = VerbsAddress | TcpAddress


class Region(abc.ABC):
    """Registered memory: `view` is the bytes, (`addr`, `rkey`) how the peer names them."""

    view: memoryview
    addr: int
    length: int
    rkey: int
    access: Access


def max_waiting(queue_depth: int) -> int:
    """How much a peer may leave waiting on a session's data plane before it ends.

    One bound for each thing a host can make pile up without ending a job: READ and
    WRITE requests it leaves unanswered (tcp, DP-3-9), frames it does not read (tcp,
    DP-3-10), and COMPLETIONs waiting for a send queue it does not drain (verbs,
    DP-2.6-6).
    """
    return max(1024, 16 * queue_depth)


def readable_view(region: Region | None, span: Span) -> memoryview | None:
    """`region`'s memory behind `span` if the region grants REMOTE_READ and holds all of it.

    What a host link sends an inline source from (`HostLink.local_view`).
    """
    if region is None or not region.access.value & _REMOTE_READ:  # IntFlag's & costs 1 us
        return None
    offset = span[0] - region.addr
    if offset < 0 or offset + span[1] > region.length:
        return None
    return region.view[offset : offset + span[1]]


class LinkSink(Protocol):
    """What an `AgentLink` reports to, from inside `poll` (the reactor thread)."""

    def on_capsule(self, data: memoryview) -> None:
        """A capsule arrived; `data` is valid only until this call returns."""

    def on_done(self, token: int, error: TransportError | None) -> None:
        """The operation posted with `token` finished (error: the link failed)."""


FastRegion = tuple[int, int, int, int]
"""A region of the session as a link's fast path checks spans against it: (addr,
length, rkey, the `Access` it grants as an int)."""

FastJob = tuple[int, int, int, int, int, int, int, int, int]
"""A job the agent link ran itself (native core): (job_id, length, destination addr,
destination rkey, deadline_ms, submit_ns, start_ns, end_ns, its WRITE's wr_id)."""

CoreJob = tuple[int, int, int, int, int, int, int, int, int]
"""A COPY the agent link started itself by READing its source (native core): (job_id,
length, source addr, source rkey, destination addr, destination rkey, deadline_ms,
submit_ns, start_ns). Open until a `CoreDone` names it or the pipeline ends it
(`AgentLink.core_cancel`)."""

CoreDone = tuple[int, int, int]
"""A `CoreJob` whose COMPLETION the link posted: (job_id, end_ns, late). late: it ended
FAILED with DEADLINE_EXCEEDED when its READ completed (nothing WRITTEN); else it
SUCCEEDED."""


class FastSink(Protocol):
    """What an agent link with a fast path asks and reports (`AgentLink.fast_regions`)."""

    default_deadline: float
    """Seconds a job gets when its SUBMIT names no deadline."""

    def fast_room(self) -> int:
        """How many jobs the link may start itself now (0: none); asked once per poll.

        The queue slots free, when every job the sink holds open is one the link
        started and nothing of the sink's waits to be sent; else 0.
        """
        raise NotImplementedError

    def on_fast_jobs(self, jobs: list[FastJob], failed: bool) -> None:  # noqa: FBT001 - positional by design
        """Jobs the link ran itself, finished and answered.

        `failed`: the last one's COMPLETION could not be posted; the link has failed.
        """
        raise NotImplementedError

    def on_core_jobs(self, jobs: list[CoreJob]) -> None:
        """Jobs the link started itself: hold them open (their READ is out)."""
        raise NotImplementedError

    def on_core_done(self, done: list[CoreDone]) -> None:
        """Jobs the link started that it answered: they end as each says."""
        raise NotImplementedError


class AgentLink(abc.ABC):
    """The agent side of one session's data plane, driven by the reactor thread.

    Completion semantics: `on_done(token, None)` means the operation posted with that
    token, and every operation posted before it on this link, finished: the data of
    a READ is in the staging buffer, a WRITE's source buffer may be reused. An
    operation posted with token None reports nothing; the caller follows it with one
    that has a token (a job's last WRITE is followed by its COMPLETION's SEND).

    Once the link fails, every outstanding token is reported with the error (once),
    `error` is set, and later posts raise it.
    """

    error: TransportError | None
    needs_polling: bool = False
    """True: completions must be polled (verbs), so the reactor polls the link while
    operations are outstanding and for a while after; False: the descriptor's readiness
    says when to poll (tcp)."""
    inline_max: int = 0
    """The largest job source a SUBMIT may carry inline on this link (docs/data-plane.md
    2.8); 0: none (on verbs every RECV buffer is max(256, 80 + inline_max) bytes)."""

    def idle_wait(self, seconds: float) -> bool:
        """Wait up to `seconds` for a capsule or an operation's completion; whether one came.

        What came is left for the next `poll`.

        For a reactor with nothing else to do. The default waits for nothing (False at
        once): a link that cannot wait cheaply is simply polled again.
        """
        del seconds
        return False

    def fast_regions(self, regions: list[FastRegion], sink: FastSink) -> bool:
        """Run COPY jobs between these regions without Python.

        The session's regions, pushed again after every change. A link that can (verbs
        with the native core) takes each SUBMIT that is a COPY passing every admission
        check while its sink's `fast_room()` allows it: an inline one it runs and
        answers at once (`on_fast_jobs`); one whose source it READs it starts
        (`on_core_jobs`) and answers once the READ is in (`on_core_done`). Every other
        capsule goes to `on_capsule` as before, in order. Returns whether the link has a
        fast path (the default: no).
        """
        del regions, sink
        return False

    def core_cancel(self, job_id: int) -> bool:
        """The sink ends a job the link started (`on_core_jobs`) before it was answered.

        True: the link will not WRITE for it nor answer it (an operation of it that is
        out still completes, DP-2.6-5); False: the link answered it already, and the
        answer is on its way to `on_core_done`. The default: True (no such jobs).
        """
        del job_id
        return True

    @property
    @abc.abstractmethod
    def address(self) -> PeerAddress | None:
        """This side's address, returned to the host in OpenSession."""

    @abc.abstractmethod
    def staging(self, length: int) -> Region:
        """DPU memory usable as READ destination and WRITE source (local only)."""

    @abc.abstractmethod
    def release(self, region: Region) -> None:
        """Return a staging region (no operation may still use it)."""

    @abc.abstractmethod
    def fileno(self) -> int:
        """The descriptor the reactor waits on (readable: call `on_event`, then `poll`)."""

    @abc.abstractmethod
    def on_event(self) -> None:
        """`fileno()` was reported ready: consume what woke the reactor."""

    @property
    @abc.abstractmethod
    def outstanding(self) -> int:
        """Operations posted and not finished (the reactor keeps polling while > 0)."""

    @property
    def wants_write(self) -> bool:
        """Whether bytes wait for the descriptor to become writable (tcp)."""
        return False

    @abc.abstractmethod
    def room(self) -> int:
        """How many more operations can be posted now."""

    @abc.abstractmethod
    def post_read(  # noqa: PLR0913, PLR0917 - an RDMA READ's operands
        self, local: Region, offset: int, length: int, addr: int, rkey: int, token: int
    ) -> None:
        """READ `length` bytes at host (`addr`, `rkey`) into `local[offset:]`."""

    @abc.abstractmethod
    def post_write(  # noqa: PLR0913, PLR0917 - an RDMA WRITE's operands
        self, local: Region, offset: int, length: int, addr: int, rkey: int, token: int | None
    ) -> None:
        """WRITE `local[offset:offset+length]` to host (`addr`, `rkey`)."""

    @abc.abstractmethod
    def post_send(self, capsule: bytes, token: int | None = None) -> None:
        """SEND one capsule (at most `MAX_CAPSULE` bytes)."""

    @abc.abstractmethod
    def flush(self) -> None:
        """Push out what was posted (tcp: write the queued frames; verbs: nothing)."""

    @abc.abstractmethod
    def poll(self, sink: LinkSink, budget: int) -> int:
        """Take up to about `budget` completions and capsules; return how many."""

    @property
    def backlog(self) -> bool:
        """Whether work already taken off the wire waits for the next `poll`.

        tcp: frames one read brought beyond a poll's budget wait in the link's buffer,
        and the descriptor's readiness will not report them, so the reactor polls the
        link again while this is true. verbs: never (what `poll` leaves stays in the
        completion queues, which the reactor polls while they may hold some).
        """
        return False

    @abc.abstractmethod
    def arm(self, sink: LinkSink) -> bool:
        """Prepare to sleep on `fileno()`; False if work arrived meanwhile (given to `sink`)."""

    def overdue(self, now: float) -> bool:  # noqa: ARG002 - verbs: RC retries bound it
        """Whether an operation is outstanding past the link's limit (monotonic `now`)."""
        return False

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything; a second call does nothing. Reports nothing."""


class HostLink(abc.ABC):
    """The host side of a session's data plane, on the SDK's asyncio loop."""

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

    @abc.abstractmethod
    def start(
        self,
        on_capsule: Callable[[memoryview], None],
        on_failure: Callable[[TransportError], None],
        expecting: Callable[[], bool],
    ) -> None:
        """Deliver received capsules and the link's failure (once) from now on.

        `expecting()` says whether answers are due (jobs in flight): a verbs link
        polls its completion queue eagerly while they are, and sleeps otherwise.
        """

    @abc.abstractmethod
    def send(self, capsules: Sequence[OutCapsule]) -> None:
        """Send capsules in order, without blocking; TransportError once failed.

        A `(submit, source)` pair is an INLINE SUBMIT and the source's bytes, sent as
        one capsule (a link whose `local_view` answers None never gets one).
        """

    def accept_inline(self, limit: int) -> int:
        """Be ready to send sources of up to `limit` bytes inline; the limit it will take.

        Called once the session's `inline_max` is known, before the first send.
        """
        return limit

    def wait(self) -> None:  # noqa: B027 - optional: most links have nothing to wait for
        """Take an answer that is due now, without a turn of the event loop, if it can.

        Called by a job's `await` when that job is the only one in flight. A link that
        can wait cheaply for the next capsule (verbs with the native core: a spin with
        the GIL released, at most its polling window) delivers it through `on_capsule`
        before returning; the default does nothing.
        """

    def call(self, capsule: OutCapsule, job_id: int) -> CompletionFields | bool:
        """Send one SUBMIT and take its job's COMPLETION in the same call, if it can.

        Called for a job alone in flight (`Session.run`). A link that can send and
        then wait cheaply for the answer (verbs with the native core: one call that
        posts, then spins with the GIL released for at most its polling window)
        returns the COMPLETION's fields (`dpu_wire.capsule.completion_fields`). True:
        the capsule was sent but its answer did not come within the window, or
        something else came first; whatever arrived is delivered through `on_capsule`
        the usual way. False: nothing was sent (the default; use `send`).
        """
        del capsule, job_id
        return False

    def local_view(self, span: Span) -> memoryview | None:
        """This side's memory behind `span`, if it names a region the agent may READ.

        What an inline source is sent from; None otherwise, and on links that do not
        carry inline sources.
        """
        del span
        return None

    @abc.abstractmethod
    async def close(self) -> None:
        """Release everything; a second call does nothing."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

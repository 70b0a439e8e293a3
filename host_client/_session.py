"""Data-plane sessions: host buffers the agent reads and writes, and jobs on them.

The fast path costs the host little: a job is a SUBMIT capsule encoded straight from
its fields and a future; its COMPLETION resolves that future from the link's callback
(no task per job, no capsule object in between). `submit_many` sends a batch of
capsules in one go. A verbs link polls its completion queue while answers are due and
sleeps on its completion channel otherwise; a tcp link is woken by its socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import uuid
from typing import TYPE_CHECKING, Final, Self

import grpc

from dpu_wire import REQUEST_ID_METADATA_KEY, capsule, endpoints
from dpu_wire.capsule import FLAG_INLINE, ZERO_SPAN, Span
from dpu_wire.jobkinds import BY_FIELD, CODECS, COMPUTE_KINDS, FLAG_FUA, KINDS, JobKind, Result
from dpu_wire.transport.base import Access, OutCapsule, TransportError
from dpu_wire.v1 import agent_pb2, common_pb2, job_pb2, session_pb2
from host_client._completion import Completion
from host_client._credits import Credits
from host_client._errors import (
    DpuError,
    FailedPreconditionError,
    InvalidArgumentError,
    UnavailableError,
    from_rpc_error,
)
from host_client._request_ids import check as check_request_id
from host_client._request_ids import current as current_request_id
from host_client._request_ids import for_call

if TYPE_CHECKING:
    from collections.abc import Callable, Generator, Iterable, Sequence
    from types import TracebackType

    from dpu_wire.transport.base import HostLink, Region
    from host_client._rpc import Rpc

log = logging.getLogger(__name__)

_FORMATS: Final = {name: number for number, name in CODECS.items()}
_COMPUTE_NAMES: Final = {KINDS[kind].field: kind for kind in COMPUTE_KINDS}
RUN_TURNS: Final = 32  # `Session.run` jobs in a row without a turn of the event loop
TRANSPORT_NUMBERS: Final = {
    "auto": agent_pb2.TRANSPORT_UNSPECIFIED,
    "verbs": agent_pb2.TRANSPORT_VERBS,
    "tcp": agent_pb2.TRANSPORT_TCP,
}
TRANSPORT_NAMES: Final = {number: name for name, number in TRANSPORT_NUMBERS.items() if number}


class Buffer:
    """Host memory registered for a session: fill or read `view`, name it in jobs.

    `buf[a:b]` is a `BufferRef` to part of it. The memory belongs to the session;
    it is freed with `Session.free` or when the session closes.
    """

    def __init__(self, session: Session, region: Region, region_id: str) -> None:
        self._session = session
        self._region = region
        self.region_id = region_id
        self.name = f"{session.name}/regions/{region_id}"

    @property
    def view(self) -> memoryview:
        """The bytes, writable; the agent reads and writes this same memory."""
        return self._region.view

    @property
    def length(self) -> int:
        """Size in bytes."""
        return self._region.length

    def __len__(self) -> int:
        return self._region.length

    def __getitem__(self, item: slice) -> BufferRef:
        start, stop, step = item.indices(self.length)
        if step != 1 or stop <= start:
            raise ValueError("a buffer slice must be contiguous and not empty")
        return BufferRef(self, start, stop - start)

    def ref(self) -> BufferRef:
        """The whole buffer."""
        return BufferRef(self, 0, self.length)

    def span(self) -> Span:
        """The (addr, length, rkey) of the whole buffer, as capsules name it."""
        return Span(self._region.addr, self._region.length, self._region.rkey)

    def _span(self, offset: int, length: int) -> Span:
        return Span(self._region.addr + offset, length, self._region.rkey)


@dataclasses.dataclass(frozen=True)
class BufferRef:
    """Part of a Buffer: `buffer[offset:offset+length]`."""

    buffer: Buffer
    offset: int
    length: int

    def span(self) -> Span:
        """The (addr, length, rkey) the agent uses."""
        return self.buffer._span(self.offset, self.length)  # noqa: SLF001 - same module

    def region_ref(self) -> common_pb2.RegionRef:
        """The API's RegionRef for the slow path."""
        return common_pb2.RegionRef(region=self.buffer.name, offset=self.offset, length=self.length)


Target = Buffer | BufferRef


def _span(target: Target) -> Span:
    return target.span()


def _ref(target: Target) -> BufferRef:
    return target.ref() if isinstance(target, Buffer) else target


@dataclasses.dataclass(frozen=True)
class JobRequest:
    """A job ready to submit as a capsule (make it with the `Session.*_request` methods).

    The fields of a SUBMIT capsule but the job id, which the session assigns.
    """

    kind: JobKind
    source: Span = ZERO_SPAN
    destination: Span = ZERO_SPAN
    deadline_ms: int = 0
    offset: int = 0
    handle: int = 0
    length: int = 0
    flags: int = 0


class Job:
    """A submitted job; `await job` gives its Completion (exactly one)."""

    __slots__ = ("_future", "_wait", "job_id", "kind")

    def __init__(
        self,
        job_id: int,
        kind: JobKind,
        future: asyncio.Future[Completion],
        wait: Callable[[], None] | None = None,
    ) -> None:
        self.job_id = job_id
        self.kind = kind
        self._future = future
        self._wait = wait  # takes a due completion without a loop turn (`HostLink.wait`)

    def done(self) -> bool:
        """Whether the completion arrived."""
        return self._future.done()

    def __await__(self) -> Generator[object, None, Completion]:
        if self._wait is not None and not self._future.done():
            self._wait()
        return self._future.__await__()


def _deadline_ms(deadline: float | None) -> int:
    if deadline is None:
        return 0
    ms = round(deadline * 1000)
    if not 0 < ms <= capsule.U32_MAX:
        raise InvalidArgumentError(
            "INVALID_ARGUMENT", f"deadline must be 0.001 to {capsule.U32_MAX // 1000} s"
        )
    return ms


class Session:
    """One data-plane session with the agent. Make it with `Client.open_session`."""

    def __init__(self, rpc: Rpc, link: HostLink, queue_depth: int, *, inline: bool = True) -> None:
        self._rpc = rpc
        self._link = link
        self.queue_depth = queue_depth
        self._inline = inline
        # the largest source sent inside a SUBMIT (the agent's offer; 0 if off or none)
        self.inline_max = 0
        self.name = ""
        self.transport = ""
        self.request_id = ""  # the OpenSession call's x-request-id
        self._credits = Credits(queue_depth)
        self._ids = itertools.count(1)
        self._run_streak = 0  # `run` calls since the event loop last turned for one
        # job id -> (future, crc32c result?) of capsule and SubmitJob jobs in flight
        self._pending: dict[int, tuple[asyncio.Future[Completion], bool]] = {}
        self._early: dict[int, Completion] = {}
        self._cancelled: set[int] = set()
        self._buffers: dict[str, Buffer] = {}
        self._volumes: dict[str, int] = {}  # volume name -> capsule handle
        self._region_ids = itertools.count(1)
        self._watcher: asyncio.Task[None] | None = None
        self._watch_ready = asyncio.Event()
        self.error: DpuError | None = None
        self.protocol_errors = 0
        self._closed = False

    # ------------------------------------------------------------------ set-up
    async def _open(self, transport: int, label: str, request_id: str | None = None) -> None:
        key = check_request_id(request_id) if request_id else uuid.uuid4().hex
        self.request_id = request_id or current_request_id() or key
        request = session_pb2.OpenSessionRequest(
            request_id=key,
            transport=transport,  # type: ignore[arg-type]
            queue_depth=self.queue_depth,
            client_label=label,
            host_endpoint=endpoints.to_proto(self._link.address),
        )
        reply: session_pb2.Session = await self._rpc.call(
            self._rpc.stubs.sessions.OpenSession, request, request_id=self.request_id
        )
        self.name = reply.name
        self.transport = TRANSPORT_NAMES.get(reply.transport, str(reply.transport))
        if self._inline and reply.inline_max:
            try:
                self.inline_max = self._link.accept_inline(
                    min(reply.inline_max, capsule.MAX_INLINE)
                )
            except TransportError as exc:  # e.g. no locked memory for larger send slots
                log.warning("inline sources off for this session (the agent READs them): %s", exc)
        try:
            await self._link.connect(endpoints.from_proto(reply.agent_endpoint))
        except TransportError as exc:
            await self._close_remote()
            raise UnavailableError("UNAVAILABLE", f"data plane did not connect: {exc}") from None
        self._link.start(self._on_capsule, self._on_failure, lambda: bool(self._pending))
        self._watcher = asyncio.create_task(self._watch(), name=f"{self.name}/watch")
        await self._watch_ready.wait()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the session on the agent, then free every buffer. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._close_remote()
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        self._fail_pending(UnavailableError("CANCELLED", "session closed by the client"))
        await self._link.close()
        self._buffers.clear()

    async def _close_remote(self) -> None:
        if not self.name:
            return
        with contextlib.suppress(DpuError):
            await self._rpc.call(
                self._rpc.stubs.sessions.CloseSession,
                session_pb2.CloseSessionRequest(name=self.name, request_id=uuid.uuid4().hex),
            )

    # ------------------------------------------------------------------ memory
    async def alloc(self, length: int, *, readable: bool = False, writable: bool = False) -> Buffer:
        """Register `length` bytes the agent may read (job input) and/or write (output)."""
        if length <= 0:
            raise InvalidArgumentError(
                "INVALID_ARGUMENT", f"buffer length must be positive: {length}"
            )
        access = (Access.REMOTE_READ if readable else Access.NONE) | (
            Access.REMOTE_WRITE if writable else Access.NONE
        )
        if not access:
            raise InvalidArgumentError("INVALID_ARGUMENT", "a buffer must be readable or writable")
        region = self._link.register(length, access)
        buffer = Buffer(self, region, f"r{next(self._region_ids)}")
        flags = [
            flag
            for flag, bit in (
                (session_pb2.REGION_ACCESS_REMOTE_READ, Access.REMOTE_READ),
                (session_pb2.REGION_ACCESS_REMOTE_WRITE, Access.REMOTE_WRITE),
            )
            if access & bit
        ]
        try:
            await self._rpc.call(
                self._rpc.stubs.sessions.AdvertiseRegions,
                session_pb2.AdvertiseRegionsRequest(
                    session=self.name,
                    request_id=uuid.uuid4().hex,
                    regions=[
                        session_pb2.MemoryRegion(
                            name=buffer.name,
                            addr=region.addr,
                            length=region.length,
                            rkey=region.rkey,
                            access=flags,
                        )
                    ],
                ),
            )
        except DpuError:
            self._link.deregister(region)
            raise
        self._buffers[buffer.region_id] = buffer
        return buffer

    async def free(self, buffer: Buffer) -> None:
        """Withdraw a buffer from the agent and release its memory.

        No job may still use it: on verbs the agent's access to a deregistered region
        ends the session, as on tcp.
        """
        if self._buffers.pop(buffer.region_id, None) is None:
            return
        with contextlib.suppress(DpuError):
            await self._rpc.call(
                self._rpc.stubs.sessions.WithdrawRegion,
                session_pb2.WithdrawRegionRequest(name=buffer.name, request_id=uuid.uuid4().hex),
            )
        self._link.deregister(buffer._region)  # noqa: SLF001

    # ------------------------------------------------------------------ requests
    def copy_request(
        self, source: Target, destination: Target, *, deadline: float | None = None
    ) -> JobRequest:
        """A copy through DPU memory (same lengths)."""
        src, dst = _span(source), _span(destination)
        if src.length != dst.length:
            raise InvalidArgumentError("INVALID_ARGUMENT", "source and destination lengths differ")
        return JobRequest(JobKind.COPY, src, dst, _deadline_ms(deadline))

    def crc32c_request(self, source: Target, *, deadline: float | None = None) -> JobRequest:
        """A CRC32C of a buffer, computed on the DPU."""
        return JobRequest(JobKind.CRC32C, _span(source), deadline_ms=_deadline_ms(deadline))

    def compute_request(
        self,
        kind: str,
        source: Target,
        destination: Target,
        *,
        parameter: int | str = 0,
        deadline: float | None = None,
    ) -> JobRequest:
        """A compute job (sha256, compress, decompress, encrypt, decrypt); see `submit_compute`."""
        job_kind = _COMPUTE_NAMES.get(kind)
        if job_kind is None:
            choices = ", ".join(_COMPUTE_NAMES)
            raise InvalidArgumentError("INVALID_ARGUMENT", f"compute kind is one of {choices}")
        if isinstance(parameter, str):
            if parameter not in _FORMATS:
                raise InvalidArgumentError("INVALID_ARGUMENT", "format is lz4 or zstd")
            parameter = _FORMATS[parameter]
        return JobRequest(
            job_kind,
            _span(source),
            _span(destination),
            _deadline_ms(deadline),
            handle=parameter,
        )

    def volume_request(  # noqa: PLR0913 - the volume job's fields
        self,
        kind: str,
        volume: str,
        *,
        offset: int = 0,
        source: Target | None = None,
        destination: Target | None = None,
        length: int = 0,
        fua: bool = False,
    ) -> JobRequest:
        """A volume job (volume_write, volume_read, volume_flush, volume_trim).

        The volume must be attached already (`await session.attach(volume)`; the
        `submit_volume_*` methods attach it themselves).
        """
        row = BY_FIELD.get(kind)
        if row is None or not row.volume:
            raise InvalidArgumentError("INVALID_ARGUMENT", f"{kind!r} is not a volume job kind")
        handle = self._volumes.get(volume)
        if handle is None:
            raise FailedPreconditionError(
                "FAILED_PRECONDITION", f"{volume} is not attached (await session.attach first)"
            )
        return JobRequest(
            row.kind,
            _span(source) if source is not None else ZERO_SPAN,
            _span(destination) if destination is not None else ZERO_SPAN,
            offset=offset,
            handle=handle,
            length=length,
            flags=FLAG_FUA if fua else 0,
        )

    # ------------------------------------------------------------------ jobs (fast path)
    async def submit(self, request: JobRequest) -> Job:
        """Submit one job as a capsule; waits for a queue credit."""
        if self.error is not None or self._closed or not self._credits.try_take():
            return (await self.submit_many((request,)))[0]
        job, out = self._prepare(request, asyncio.get_running_loop())
        self._send((out,))
        return job

    async def run(self, request: JobRequest) -> Completion:
        """Submit one job and wait for its Completion: `await (await submit(request))`.

        Faster for a job alone in flight on a verbs link with the native core: the
        SUBMIT's post and the wait for its COMPLETION are one call into the core
        (`HostLink.call`), without a future or a turn of the event loop in between.
        The wait spins for at most the session's `poll_spin`, and after `RUN_TURNS`
        such jobs in a row the event loop turns once for the program's other tasks; a
        job that takes longer completes the usual way. Like `await job`, it returns
        the Completion whatever the job's state (`raise_for_status` raises).
        """
        if self._pending or self.error is not None or self._closed:
            self._run_streak = 0
            return await (await self.submit(request))
        if self._run_streak >= RUN_TURNS:
            self._run_streak = 0
            await asyncio.sleep(0)
            return await self.run(request)
        if not self._credits.try_take():
            return await (await self.submit(request))
        job_id = next(self._ids)
        out, crc = self._encode(job_id, request)
        try:
            got = self._link.call(out, job_id)
        except TransportError as exc:
            self._credits.give()
            self._on_failure(exc)
            raise (self.error or exc) from None
        except BaseException:
            self._credits.give()
            raise
        if got is True or got is False:  # the usual way: the COMPLETION comes on the loop
            self._run_streak = 0
            job = self._track(job_id, request.kind, asyncio.get_running_loop(), crc=crc)
            if got is False:  # the link did not send it
                self._send((out,))
            return await job
        self._run_streak += 1
        self._credits.give()
        return Completion.from_fields(got, crc32c_job=crc)

    async def submit_many(self, requests: Iterable[JobRequest]) -> list[Job]:
        """Submit jobs as capsules in one send, waiting for credits as needed.

        Jobs beyond the free credits wait for earlier ones to complete; those are sent
        as soon as their credit is there (so a list longer than `queue_depth` works).
        """
        self._require_usable()
        loop = asyncio.get_running_loop()
        jobs: list[Job] = []
        batch: list[OutCapsule] = []
        slots = self._credits
        for request in requests:
            if not slots.try_take():
                if batch:  # send what has credits before waiting for more
                    self._send(batch)
                    batch = []
                await slots.take()
            if self.error is not None:
                slots.give()
                raise self.error
            job, out = self._prepare(request, loop)
            batch.append(out)
            jobs.append(job)
        if batch:
            self._send(batch)
        return jobs

    def _prepare(
        self, request: JobRequest, loop: asyncio.AbstractEventLoop
    ) -> tuple[Job, OutCapsule]:
        """A job and its SUBMIT for `request`, whose credit is taken (given back on error)."""
        job_id = next(self._ids)
        out, crc = self._encode(job_id, request)
        return self._track(job_id, request.kind, loop, crc=crc), out

    def _track(
        self, job_id: int, kind: JobKind, loop: asyncio.AbstractEventLoop, *, crc: bool
    ) -> Job:
        """A capsule job whose COMPLETION the link will deliver (`_on_capsule`)."""
        future: asyncio.Future[Completion] = loop.create_future()
        self._pending[job_id] = (future, crc)
        return Job(job_id, kind, future, self._wait_alone)

    def _encode(self, job_id: int, request: JobRequest) -> tuple[OutCapsule, bool]:
        """The SUBMIT of job `job_id`, and whether its result is a CRC32C.

        Its credit is taken; given back if the request does not fit a SUBMIT.
        """
        row = KINDS[request.kind]
        source, flags, inline = request.source, request.flags, None
        if 0 < source[1] <= self.inline_max and row.source:
            inline = self._link.local_view(source)  # None: the agent refuses the span
            if inline is not None:
                source, flags = Span(0, source[1], 0), flags | FLAG_INLINE
        try:
            submit = capsule.pack_submit(
                job_id,
                request.kind,
                source,
                request.destination,
                deadline_ms=request.deadline_ms,
                offset=request.offset,
                handle=request.handle,
                length=request.length,
                flags=flags,
            )
        except ValueError as exc:
            self._credits.give()
            raise InvalidArgumentError("INVALID_ARGUMENT", str(exc)) from None
        return (submit if inline is None else (submit, inline)), row.result is Result.CRC32C

    def _wait_alone(self) -> None:
        """Let the link take the completion of the only job in flight (`HostLink.wait`).

        Only then: a spin keeps the event loop from the program's other tasks, which
        with several jobs in flight have completions coming anyway.
        """
        if len(self._pending) == 1 and self.error is None:
            self._link.wait()

    def _send(self, capsules: Sequence[OutCapsule]) -> None:
        try:
            self._link.send(capsules)
        except TransportError as exc:
            self._on_failure(exc)

    async def submit_copy(
        self, source: Target, destination: Target, *, deadline: float | None = None
    ) -> Job:
        """Queue a copy through DPU memory as a capsule; waits for a queue credit."""
        return await self.submit(self.copy_request(source, destination, deadline=deadline))

    async def submit_crc32c(self, source: Target, *, deadline: float | None = None) -> Job:
        """Queue a CRC32C of a buffer as a capsule; waits for a queue credit."""
        return await self.submit(self.crc32c_request(source, deadline=deadline))

    async def copy(
        self, source: Target, destination: Target, *, deadline: float | None = None
    ) -> Completion:
        """Copy and wait; raise the matching DpuError if the job failed."""
        done = await self.run(self.copy_request(source, destination, deadline=deadline))
        return done.raise_for_status()

    async def crc32c(self, source: Target, *, deadline: float | None = None) -> int:
        """CRC32C computed on the DPU; raise if the job failed."""
        completion = await self.run(self.crc32c_request(source, deadline=deadline))
        completion.raise_for_status()
        assert completion.crc32c is not None  # noqa: S101 - a succeeded crc32c job has one
        return completion.crc32c

    async def cancel(self, job: Job) -> None:
        """Ask the agent to cancel a job; its completion says whether it did."""
        if job.done() or job.job_id in self._cancelled:
            return
        if job.job_id >= capsule.AGENT_JOB_ID_BASE:
            await self._rpc.call(
                self._rpc.stubs.jobs.CancelJob,
                job_pb2.CancelJobRequest(
                    name=f"{self.name}/jobs/{job.job_id}", request_id=uuid.uuid4().hex
                ),
            )
            return
        self._cancelled.add(job.job_id)  # one CANCEL per job: the send ring holds them
        self._send([capsule.Cancel(job.job_id).encode()])

    # ------------------------------------------------------------------ jobs (slow path)
    async def submit_rpc(
        self,
        kind: str,
        source: Target,
        destination: Target | None = None,
        *,
        deadline: float | None = None,
        request_id: str | None = None,
    ) -> Job:
        """Queue a copy or crc32c through JobService.SubmitJob; completes on the watch stream."""
        self._require_usable()
        spec = job_pb2.JobSpec()
        if kind == "copy":
            if destination is None:
                raise InvalidArgumentError("INVALID_ARGUMENT", "copy needs a destination")
            spec.copy.source.CopyFrom(_ref(source).region_ref())
            spec.copy.destination.CopyFrom(_ref(destination).region_ref())
        elif kind == "crc32c":
            spec.crc32c.source.CopyFrom(_ref(source).region_ref())
        else:
            raise InvalidArgumentError("INVALID_ARGUMENT", f"unknown job kind {kind!r}")
        if deadline:
            spec.deadline.FromNanoseconds(int(deadline * 1e9))
        return await self.submit_spec(spec, request_id=request_id)

    async def submit_spec(self, spec: job_pb2.JobSpec, *, request_id: str | None = None) -> Job:
        """Queue any dpu.v1 JobSpec through SubmitJob (e.g. volume jobs by volume name).

        `request_id` is the call's id and idempotency key (a retry with the same one
        gets the first job back); the job's completion event carries it. A volume job's
        volume is attached to the session first (the agent takes volume jobs only for
        attached volumes).
        """
        self._require_usable()
        key = check_request_id(request_id) if request_id else uuid.uuid4().hex
        rid = request_id or current_request_id() or key
        kind = spec.WhichOneof("kind") or ""
        row = BY_FIELD.get(kind)
        if row is None:
            raise InvalidArgumentError("INVALID_ARGUMENT", "the JobSpec names no job kind")
        if row.volume:
            await self.attach(getattr(spec, kind).volume)
        await self._credits.take()
        try:
            reply: job_pb2.Job = await self._rpc.call(
                self._rpc.stubs.jobs.SubmitJob,
                job_pb2.SubmitJobRequest(
                    session=self.name, spec=spec, request_id=key, wait_for_slot=True
                ),
                request_id=rid,
            )
        except BaseException:
            self._credits.give()
            raise
        future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        early = self._early.pop(reply.job_id, None)
        if early is not None:
            self._credits.give()
            future.set_result(early)
        elif self.error is not None or self._closed:  # failed or closed during SubmitJob:
            self._credits.give()  # no completion will come, and nothing fails it later
            future.set_exception(
                self.error or UnavailableError("CANCELLED", "session closed by the client")
            )
        else:
            self._pending[reply.job_id] = (future, row.result is Result.CRC32C)
        return Job(reply.job_id, row.kind, future)

    # ------------------------------------------------------------------ volumes (fast path)
    async def attach(self, volume: str) -> int:
        """The handle this session's capsules use for a volume ("volumes/{id}")."""
        handle = self._volumes.get(volume)
        if handle is None:
            reply: session_pb2.VolumeAttachment = await self._rpc.call(
                self._rpc.stubs.sessions.AttachVolume,
                session_pb2.AttachVolumeRequest(
                    session=self.name, volume=volume, request_id=uuid.uuid4().hex
                ),
            )
            handle = self._volumes[volume] = reply.handle
        return handle

    async def submit_volume_write(
        self, volume: str, offset: int, source: Target, *, fua: bool = False
    ) -> Job:
        """Queue a write of host memory to a volume at `offset` (block aligned)."""
        return await self.submit(await self._write_request(volume, offset, source, fua=fua))

    async def submit_volume_read(self, volume: str, offset: int, destination: Target) -> Job:
        """Queue a read of a volume at `offset` into host memory (block aligned)."""
        return await self.submit(await self._read_request(volume, offset, destination))

    async def submit_volume_flush(self, volume: str) -> Job:
        """Queue a flush: what was written is on stable storage when it completes."""
        await self.attach(volume)
        return await self.submit(self.volume_request("volume_flush", volume))

    async def submit_volume_trim(self, volume: str, offset: int, length: int) -> Job:
        """Queue a trim of a block-aligned range (it reads as zeros afterwards)."""
        await self.attach(volume)
        return await self.submit(
            self.volume_request("volume_trim", volume, offset=offset, length=length)
        )

    async def write_volume(
        self, volume: str, offset: int, source: Target, *, fua: bool = False
    ) -> Completion:
        """Write and wait; raise the matching DpuError if it failed."""
        request = await self._write_request(volume, offset, source, fua=fua)
        return (await self.run(request)).raise_for_status()

    async def read_volume(self, volume: str, offset: int, destination: Target) -> Completion:
        """Read and wait; raise the matching DpuError (DataLossError on a bad CRC)."""
        request = await self._read_request(volume, offset, destination)
        return (await self.run(request)).raise_for_status()

    async def _write_request(
        self, volume: str, offset: int, source: Target, *, fua: bool
    ) -> JobRequest:
        await self.attach(volume)
        return self.volume_request("volume_write", volume, offset=offset, source=source, fua=fua)

    async def _read_request(self, volume: str, offset: int, destination: Target) -> JobRequest:
        await self.attach(volume)
        return self.volume_request("volume_read", volume, offset=offset, destination=destination)

    # ------------------------------------------------------------------ compute (fast path)
    async def register_key(self, key: bytes) -> int:
        """A handle for an AES key (16, 24 or 32 bytes) for encrypt/decrypt jobs."""
        reply: session_pb2.KeyHandle = await self._rpc.call(
            self._rpc.stubs.sessions.RegisterKey,
            session_pb2.RegisterKeyRequest(session=self.name, key=key, request_id=uuid.uuid4().hex),
        )
        return reply.handle

    async def submit_compute(
        self, kind: str, source: Target, destination: Target, *, parameter: int | str = 0
    ) -> Job:
        """Queue a compute job; the output is WRITTEN to `destination`.

        `kind`: sha256, compress or decompress (parameter: "lz4" or "zstd"), encrypt or
        decrypt (parameter: a key handle from `register_key`). The output's size is the
        completion's bytes_written.
        """
        return await self.submit(
            self.compute_request(kind, source, destination, parameter=parameter)
        )

    async def compute(
        self, kind: str, source: Target, destination: Target, *, parameter: int | str = 0
    ) -> Completion:
        """A compute job, waited for; raise the matching DpuError if it failed."""
        job = await self.submit_compute(kind, source, destination, parameter=parameter)
        return (await job).raise_for_status()

    # ------------------------------------------------------------------ completions
    def _on_capsule(self, data: memoryview) -> None:
        """The link delivered a capsule: resolve the job it completes."""
        try:
            opcode, _ = capsule.peek_header(data)
            f = capsule.completion_fields(data) if opcode == capsule.Opcode.COMPLETION else None
        except capsule.CapsuleError:
            f = None
        if f is None:  # undecodable, or not a COMPLETION: a host receives nothing else
            self.protocol_errors += 1
            return
        entry = self._pending.pop(f[0], None)
        if entry is None:
            self.protocol_errors += 1  # e.g. the answer to an undecodable capsule
            log.warning("completion for unknown job %d: %s", f[0], f[9])
            return
        future, crc = entry
        self._credits.give()
        self._cancelled.discard(f[0])
        if not future.done():
            future.set_result(Completion.from_fields(f, crc32c_job=crc))

    async def _watch(self) -> None:
        """Hold the session's watch stream (the agent's sign that this host is alive)."""
        stream = self._rpc.stubs.jobs.WatchCompletions(
            job_pb2.WatchCompletionsRequest(session=self.name, origin=job_pb2.JOB_ORIGIN_RPC),
            metadata=((REQUEST_ID_METADATA_KEY, for_call()),),
        )
        try:
            await stream.wait_for_connection()
            self._watch_ready.set()
            async for message in stream:
                completion = Completion.from_proto(message)
                entry = self._pending.pop(message.job_id, None)
                if entry is None:
                    self._early[message.job_id] = completion
                    continue
                self._credits.give()
                if not entry[0].done():
                    entry[0].set_result(completion)
        except grpc.aio.AioRpcError as exc:
            if not self._closed:
                self._on_failure(from_rpc_error(exc))
        finally:
            self._watch_ready.set()

    def _on_failure(self, exc: BaseException) -> None:
        if self._closed or self.error is not None:
            return
        if isinstance(exc, DpuError):
            self.error = exc
        else:
            self.error = UnavailableError("UNAVAILABLE", f"{self.name}: data plane failed: {exc}")
        log.warning("session failed: %s", self.error)
        self._fail_pending(self.error)

    def _fail_pending(self, error: DpuError) -> None:
        pending, self._pending = self._pending, {}
        for future, _ in pending.values():
            if not future.done():
                future.set_exception(error)

    def _require_usable(self) -> None:
        if self._closed:
            raise FailedPreconditionError("FAILED_PRECONDITION", "the session is closed")
        if self.error is not None:
            raise self.error

    @property
    def failed(self) -> bool:
        """Whether the data plane failed; open a new session to continue."""
        return self.error is not None

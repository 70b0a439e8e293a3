"""Data-plane sessions: host buffers the agent reads and writes, and jobs on them."""

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
from dpu_wire.capsule import JobKind, Span
from dpu_wire.transport.base import Access, TransportError
from dpu_wire.v1 import agent_pb2, common_pb2, job_pb2, session_pb2
from host_client import _request_ids
from host_client._completion import Completion
from host_client._errors import (
    DpuError,
    FailedPreconditionError,
    InvalidArgumentError,
    UnavailableError,
    from_rpc_error,
)

if TYPE_CHECKING:
    from collections.abc import Generator
    from types import TracebackType

    from dpu_wire.transport.base import HostTransport, Region
    from host_client._client import Client

log = logging.getLogger(__name__)

_SPEC_KINDS: Final = {
    "copy": JobKind.COPY,
    "crc32c": JobKind.CRC32C,
    "volume_write": JobKind.VOLUME_WRITE,
    "volume_read": JobKind.VOLUME_READ,
    "volume_flush": JobKind.VOLUME_FLUSH,
    "volume_trim": JobKind.VOLUME_TRIM,
    "sha256": JobKind.SHA256,
    "compress": JobKind.COMPRESS,
    "decompress": JobKind.DECOMPRESS,
    "encrypt": JobKind.ENCRYPT,
    "decrypt": JobKind.DECRYPT,
}
_COMPUTE_KINDS: Final = {name: kind for name, kind in _SPEC_KINDS.items() if kind >= JobKind.SHA256}
_FORMATS: Final = {"lz4": 1, "zstd": 2}
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


def _ref(target: Target) -> BufferRef:
    return target.ref() if isinstance(target, Buffer) else target


class Job:
    """A submitted job; `await job` gives its Completion (exactly one)."""

    def __init__(self, job_id: int, kind: JobKind, future: asyncio.Future[Completion]) -> None:
        self.job_id = job_id
        self.kind = kind
        self._future = future

    def done(self) -> bool:
        """Whether the completion arrived."""
        return self._future.done()

    def __await__(self) -> Generator[object, None, Completion]:
        return self._future.__await__()


class Session:
    """One data-plane session with the agent. Make it with `Client.open_session`."""

    def __init__(self, client: Client, transport: HostTransport, queue_depth: int) -> None:
        self._client = client
        self._transport = transport
        self.queue_depth = queue_depth
        self.name = ""
        self.transport = ""
        self.request_id = ""  # the OpenSession call's x-request-id
        self._credits = asyncio.Semaphore(queue_depth)
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[asyncio.Future[Completion], JobKind]] = {}
        self._early: dict[int, Completion] = {}
        self._buffers: dict[str, Buffer] = {}
        self._volumes: dict[str, int] = {}  # volume name -> capsule handle
        self._region_ids = itertools.count(1)
        self._reader: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._watch_ready = asyncio.Event()
        self.error: DpuError | None = None
        self.protocol_errors = 0
        self._closed = False

    # ------------------------------------------------------------------ set-up
    async def _open(self, transport: int, label: str, request_id: str | None = None) -> None:
        key = _request_ids.check(request_id) if request_id else uuid.uuid4().hex
        self.request_id = request_id or _request_ids.current() or key
        request = session_pb2.OpenSessionRequest(
            request_id=key,
            transport=transport,  # type: ignore[arg-type]
            queue_depth=self.queue_depth,
            client_label=label,
            host_endpoint=endpoints.to_proto(self._transport.address),
        )
        reply: session_pb2.Session = await self._client._call(  # noqa: SLF001
            self._client.stubs.sessions.OpenSession, request, request_id=self.request_id
        )
        self.name = reply.name
        self.transport = TRANSPORT_NAMES.get(reply.transport, str(reply.transport))
        try:
            await self._transport.connect(endpoints.from_proto(reply.agent_endpoint))
        except TransportError as exc:
            await self._close_remote()
            raise UnavailableError("UNAVAILABLE", f"data plane did not connect: {exc}") from None
        self._reader = asyncio.create_task(self._read_completions(), name=f"{self.name}/reader")
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
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._fail_pending(UnavailableError("CANCELLED", "session closed by the client"))
        await self._transport.close()
        self._buffers.clear()

    async def _close_remote(self) -> None:
        if not self.name:
            return
        with contextlib.suppress(DpuError):
            await self._client._call(  # noqa: SLF001
                self._client.stubs.sessions.CloseSession,
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
        region = self._transport.register(length, access)
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
            await self._client._call(  # noqa: SLF001
                self._client.stubs.sessions.AdvertiseRegions,
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
            self._transport.deregister(region)
            raise
        self._buffers[buffer.region_id] = buffer
        return buffer

    async def free(self, buffer: Buffer) -> None:
        """Withdraw a buffer from the agent and release its memory."""
        if self._buffers.pop(buffer.region_id, None) is None:
            return
        with contextlib.suppress(DpuError):
            await self._client._call(  # noqa: SLF001
                self._client.stubs.sessions.WithdrawRegion,
                session_pb2.WithdrawRegionRequest(name=buffer.name, request_id=uuid.uuid4().hex),
            )
        self._transport.deregister(buffer._region)  # noqa: SLF001

    # ------------------------------------------------------------------ jobs (fast path)
    async def submit_copy(
        self, source: Target, destination: Target, *, deadline: float | None = None
    ) -> Job:
        """Queue a copy through DPU memory as a capsule; waits for a queue credit."""
        src, dst = _ref(source), _ref(destination)
        if src.length != dst.length:
            raise InvalidArgumentError("INVALID_ARGUMENT", "source and destination lengths differ")
        return await self._submit(JobKind.COPY, src.span(), dst.span(), deadline)

    async def submit_crc32c(self, source: Target, *, deadline: float | None = None) -> Job:
        """Queue a CRC32C of a buffer as a capsule; waits for a queue credit."""
        return await self._submit(JobKind.CRC32C, _ref(source).span(), Span(), deadline)

    async def copy(
        self, source: Target, destination: Target, *, deadline: float | None = None
    ) -> Completion:
        """Copy and wait; raise the matching DpuError if the job failed."""
        job = await self.submit_copy(source, destination, deadline=deadline)
        return (await job).raise_for_status()

    async def crc32c(self, source: Target, *, deadline: float | None = None) -> int:
        """CRC32C computed on the DPU; raise if the job failed."""
        completion = (
            await (await self.submit_crc32c(source, deadline=deadline))
        ).raise_for_status()
        assert completion.crc32c is not None  # noqa: S101 - a succeeded crc32c job has one
        return completion.crc32c

    async def _submit(  # noqa: PLR0913 - a SUBMIT capsule's fields
        self,
        kind: JobKind,
        source: Span,
        destination: Span,
        deadline: float | None,
        *,
        offset: int = 0,
        handle: int = 0,
        length: int = 0,
        flags: int = 0,
    ) -> Job:
        self._require_usable()
        await self._credits.acquire()
        if self.error is not None:
            self._credits.release()
            raise self.error
        job_id = next(self._ids)
        future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self._pending[job_id] = (future, kind)
        message = capsule.Submit(
            job_id=job_id,
            kind=kind,
            source=source,
            destination=destination,
            deadline_ms=int((deadline or 0) * 1000),
            offset=offset,
            handle=handle,
            length=length,
            flags=flags,
        )
        try:
            await self._transport.send(message.encode())
        except TransportError as exc:
            self._on_failure(exc)
        return Job(job_id, kind, future)

    async def cancel(self, job: Job) -> None:
        """Ask the agent to cancel a job; its completion says whether it did."""
        if job.job_id >= capsule.AGENT_JOB_ID_BASE:
            await self._client._call(  # noqa: SLF001
                self._client.stubs.jobs.CancelJob,
                job_pb2.CancelJobRequest(
                    name=f"{self.name}/jobs/{job.job_id}", request_id=uuid.uuid4().hex
                ),
            )
            return
        try:
            await self._transport.send(capsule.Cancel(job.job_id).encode())
        except TransportError as exc:
            self._on_failure(exc)

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
        """Queue a job through JobService.SubmitJob; its completion comes on the watch stream."""
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
        key = _request_ids.check(request_id) if request_id else uuid.uuid4().hex
        rid = request_id or _request_ids.current() or key
        kind = spec.WhichOneof("kind") or ""
        job_kind = _SPEC_KINDS.get(kind)
        if job_kind is None:
            raise InvalidArgumentError("INVALID_ARGUMENT", "the JobSpec names no job kind")
        if kind.startswith("volume_"):
            await self.attach(getattr(spec, kind).volume)
        await self._credits.acquire()
        try:
            reply: job_pb2.Job = await self._client._call(  # noqa: SLF001
                self._client.stubs.jobs.SubmitJob,
                job_pb2.SubmitJobRequest(
                    session=self.name, spec=spec, request_id=key, wait_for_slot=True
                ),
                request_id=rid,
            )
        except BaseException:
            self._credits.release()
            raise
        future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        early = self._early.pop(reply.job_id, None)
        if early is not None:
            self._credits.release()
            future.set_result(early)
        elif self.error is not None or self._closed:  # failed or closed during SubmitJob:
            self._credits.release()  # no completion will come, and nothing fails it later
            future.set_exception(
                self.error or UnavailableError("CANCELLED", "session closed by the client")
            )
        else:
            self._pending[reply.job_id] = (future, job_kind)
        return Job(reply.job_id, job_kind, future)

    # ------------------------------------------------------------------ volumes (fast path)
    async def attach(self, volume: str) -> int:
        """The handle this session's capsules use for a volume ("volumes/{id}")."""
        handle = self._volumes.get(volume)
        if handle is None:
            reply: session_pb2.VolumeAttachment = await self._client._call(  # noqa: SLF001
                self._client.stubs.sessions.AttachVolume,
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
        handle = await self.attach(volume)
        flags = capsule.FLAG_FUA if fua else 0
        span = _ref(source).span()
        return await self._submit(
            JobKind.VOLUME_WRITE, span, Span(), None, offset=offset, handle=handle, flags=flags
        )

    async def submit_volume_read(self, volume: str, offset: int, destination: Target) -> Job:
        """Queue a read of a volume at `offset` into host memory (block aligned)."""
        handle = await self.attach(volume)
        span = _ref(destination).span()
        return await self._submit(
            JobKind.VOLUME_READ, Span(), span, None, offset=offset, handle=handle
        )

    async def submit_volume_flush(self, volume: str) -> Job:
        """Queue a flush: what was written is on stable storage when it completes."""
        handle = await self.attach(volume)
        return await self._submit(JobKind.VOLUME_FLUSH, Span(), Span(), None, handle=handle)

    async def submit_volume_trim(self, volume: str, offset: int, length: int) -> Job:
        """Queue a trim of a block-aligned range (it reads as zeros afterwards)."""
        handle = await self.attach(volume)
        return await self._submit(
            JobKind.VOLUME_TRIM, Span(), Span(), None, offset=offset, handle=handle, length=length
        )

    # ------------------------------------------------------------------ compute (fast path)
    async def register_key(self, key: bytes) -> int:
        """A handle for an AES key (16, 24 or 32 bytes) for encrypt/decrypt jobs."""
        reply: session_pb2.KeyHandle = await self._client._call(  # noqa: SLF001
            self._client.stubs.sessions.RegisterKey,
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
        job_kind = _COMPUTE_KINDS.get(kind)
        if job_kind is None:
            choices = ", ".join(_COMPUTE_KINDS)
            raise InvalidArgumentError("INVALID_ARGUMENT", f"compute kind is one of {choices}")
        if isinstance(parameter, str):
            if parameter not in _FORMATS:
                raise InvalidArgumentError("INVALID_ARGUMENT", "format is lz4 or zstd")
            parameter = _FORMATS[parameter]
        src, dst = _ref(source).span(), _ref(destination).span()
        return await self._submit(job_kind, src, dst, None, handle=parameter)

    async def compute(
        self, kind: str, source: Target, destination: Target, *, parameter: int | str = 0
    ) -> Completion:
        """A compute job, waited for; raise the matching DpuError if it failed."""
        job = await self.submit_compute(kind, source, destination, parameter=parameter)
        return (await job).raise_for_status()

    async def write_volume(
        self, volume: str, offset: int, source: Target, *, fua: bool = False
    ) -> Completion:
        """Write and wait; raise the matching DpuError if it failed."""
        job = await self.submit_volume_write(volume, offset, source, fua=fua)
        return (await job).raise_for_status()

    async def read_volume(self, volume: str, offset: int, destination: Target) -> Completion:
        """Read and wait; raise the matching DpuError (DataLossError on a bad CRC)."""
        job = await self.submit_volume_read(volume, offset, destination)
        return (await job).raise_for_status()

    # ------------------------------------------------------------------ completions
    async def _read_completions(self) -> None:
        try:
            while True:
                data = await self._transport.recv()
                try:
                    message = capsule.decode(data)
                except capsule.CapsuleError:
                    self.protocol_errors += 1
                    continue
                if not isinstance(message, capsule.Completion):
                    self.protocol_errors += 1
                    continue
                entry = self._pending.pop(message.job_id, None)
                if entry is None:
                    self.protocol_errors += 1  # e.g. the answer to an undecodable capsule
                    log.warning(
                        "completion for unknown job %d: %s", message.job_id, message.message
                    )
                    continue
                future, kind = entry
                self._credits.release()
                if not future.done():
                    future.set_result(
                        Completion.from_capsule(message, crc32c_job=kind == JobKind.CRC32C)
                    )
        except TransportError as exc:
            self._on_failure(exc)

    async def _watch(self) -> None:
        """Hold the session's watch stream (the agent's sign that this host is alive)."""
        stream = self._client.stubs.jobs.WatchCompletions(
            job_pb2.WatchCompletionsRequest(session=self.name, origin=job_pb2.JOB_ORIGIN_RPC),
            metadata=((REQUEST_ID_METADATA_KEY, _request_ids.for_call()),),
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
                self._credits.release()
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
        for future, _ in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()

    def _require_usable(self) -> None:
        if self._closed:
            raise FailedPreconditionError("FAILED_PRECONDITION", "the session is closed")
        if self.error is not None:
            raise self.error

    @property
    def failed(self) -> bool:
        """Whether the data plane failed; open a new session to continue."""
        return self.error is not None

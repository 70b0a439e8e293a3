"""Jobs: what a job is, its one-way state machine, and how each kind runs.

A job moves QUEUED → RUNNING → (SUCCEEDED | FAILED | CANCELLED), or straight from
QUEUED to FAILED/CANCELLED. `JobRecord.finish` is the only way into a final state
and refuses a second time, which is what makes a completion exactly-once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import hashlib
import time
from typing import TYPE_CHECKING, Final

import crc32c

from dpu_agent import status
from dpu_agent.auth import DEFAULT_TENANT
from dpu_agent.dataplane import compute
from dpu_agent.errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from dpu_wire import capsule
from dpu_wire.capsule import VOLUME_KINDS, JobKind, Span, State
from dpu_wire.transport.base import Access

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from dpu_agent.dataplane.regions import RegionTable
    from dpu_agent.storage import VolumeStore
    from dpu_wire.transport.base import AgentTransport, Region


class Origin(enum.Enum):
    """How the job arrived, and so where its completion capsule goes."""

    CAPSULE = "capsule"  # SEND on the data plane: the completion is SENT back too
    GRPC = "grpc"  # SubmitJob: the completion goes to watchers only


class JobState(enum.IntEnum):
    """dpu.v1.JobState numbers."""

    QUEUED = 1
    RUNNING = 2
    SUCCEEDED = 3
    FAILED = 4
    CANCELLED = 5


@dataclasses.dataclass
class Outcome:
    """What a finished job reports."""

    bytes_read: int = 0
    bytes_written: int = 0
    result: int = 0


@dataclasses.dataclass
class JobRecord:
    """One job of a session."""

    job_id: int
    kind: JobKind
    source: Span
    destination: Span
    origin: Origin
    deadline: float  # time.monotonic() by which it must finish
    request_id: str = ""  # SubmitJob's idempotency key ("" for capsules)
    # x-request-id of the RPC that made the job: its SubmitJob, or its session's
    # OpenSession for capsule jobs ("" when none); completion events carry it
    rpc_request_id: str = ""
    volume_id: str = ""  # volume kinds: the volume ("" for the others)
    offset: int = 0  # volume kinds: byte offset in the volume
    length: int = 0  # VOLUME_TRIM: bytes to trim
    fua: bool = False  # VOLUME_WRITE: durable before the completion
    parameter: int = 0  # COMPRESS/DECOMPRESS: the format
    key: bytes = dataclasses.field(default=b"", repr=False)  # ENCRYPT/DECRYPT; never shown
    digest: bytes = b""  # SHA256: the result
    submit_ns: int = dataclasses.field(default_factory=time.time_ns)
    state: JobState = JobState.QUEUED
    start_ns: int = 0
    cancel_requested: bool = False
    progress: Outcome = dataclasses.field(default_factory=Outcome)
    completion: capsule.Completion | None = None

    @property
    def done(self) -> bool:
        """Whether the job reached a final state."""
        return self.completion is not None

    def start(self) -> None:
        """QUEUED → RUNNING."""
        self.state = JobState.RUNNING
        self.start_ns = time.time_ns()

    def finish(
        self,
        state: State,
        code: int = status.OK,
        message: str = "",
    ) -> capsule.Completion | None:
        """Enter a final state once; return the completion, or None if already final."""
        if self.completion is not None:
            return None
        self.state = JobState(int(state))
        outcome = self.progress
        self.completion = capsule.Completion(
            job_id=self.job_id,
            state=state,
            status=code,
            bytes_read=outcome.bytes_read,
            bytes_written=outcome.bytes_written,
            result=outcome.result,
            submit_ns=self.submit_ns,
            start_ns=self.start_ns,
            end_ns=time.time_ns(),
            message=message,
        )
        return self.completion


# kind -> (reads host memory: source span, writes host memory: destination span)
SPANS: Final = {
    JobKind.COPY: (True, True),
    JobKind.CRC32C: (True, False),
    JobKind.VOLUME_WRITE: (True, False),
    JobKind.VOLUME_READ: (False, True),
    JobKind.VOLUME_FLUSH: (False, False),
    JobKind.VOLUME_TRIM: (False, False),
    JobKind.SHA256: (True, True),
    JobKind.COMPRESS: (True, True),
    JobKind.DECOMPRESS: (True, True),
    JobKind.ENCRYPT: (True, True),
    JobKind.DECRYPT: (True, True),
}
SHA256_BYTES: Final = 32


def check_spans(job: JobRecord, regions: RegionTable) -> None:
    """Reject a job whose spans do not fit the session's regions, before any RDMA op."""
    what = job.kind.name.lower()
    reads, writes = SPANS[job.kind]
    if reads:
        regions.check_span(job.source, Access.REMOTE_READ, "source")
    elif job.source != Span():
        raise InvalidArgument(f"{what}: takes no source")
    if writes:
        regions.check_span(job.destination, Access.REMOTE_WRITE, "destination")
    elif job.destination != Span():
        raise InvalidArgument(f"{what}: takes no destination")
    if job.kind == JobKind.COPY and job.destination.length != job.source.length:
        raise InvalidArgument(
            f"copy: destination length {job.destination.length} differs from source "
            f"length {job.source.length}"
        )
    if job.kind in VOLUME_KINDS and not job.volume_id:
        raise InvalidArgument(f"{what}: names no volume")
    if job.kind == JobKind.SHA256 and job.destination.length < SHA256_BYTES:
        raise InvalidArgument(f"sha256: the destination must hold {SHA256_BYTES} bytes")
    if job.kind in (JobKind.COMPRESS, JobKind.DECOMPRESS):
        compute.check_format(job.parameter)
    if job.kind in (JobKind.ENCRYPT, JobKind.DECRYPT) and not job.key:
        raise InvalidArgument(f"{what}: no key is registered under that handle")


class StagingPool:
    """DPU-side buffers for READ destinations and WRITE sources, made once per session."""

    def __init__(self, transport: AgentTransport, chunk: int, count: int) -> None:
        self.chunk = chunk
        self._transport = transport
        self._all = [transport.staging(chunk) for _ in range(count)]
        self._free: asyncio.Queue[Region] = asyncio.Queue()
        for region in self._all:
            self._free.put_nowait(region)

    async def acquire(self) -> Region:
        """A free buffer (waits while all are in use)."""
        return await self._free.get()

    def give_back(self, region: Region) -> None:
        """Return a buffer; its operations must have completed."""
        self._free.put_nowait(region)

    def close(self) -> None:
        """Release every buffer."""
        for region in self._all:
            self._transport.release(region)
        self._all.clear()


class JobRunner:
    """Runs jobs chunk by chunk through one staging buffer per running job.

    Cancellation and the deadline are checked between chunks: an RDMA operation
    already posted is always waited for, so a staging buffer is never reused while
    the NIC may still write into it.
    """

    def __init__(
        self,
        transport: AgentTransport,
        pool: StagingPool,
        store: VolumeStore | None = None,
        *,
        tenant: str = DEFAULT_TENANT,
    ) -> None:
        self._transport = transport
        self._pool = pool
        self._store = store
        self._tenant = tenant  # volume jobs touch this tenant's volumes only
        self._kinds = {
            JobKind.COPY: self._copy,
            JobKind.CRC32C: self._crc32c,
            JobKind.VOLUME_WRITE: self._volume_write,
            JobKind.VOLUME_READ: self._volume_read,
            JobKind.VOLUME_FLUSH: self._volume_flush,
            JobKind.VOLUME_TRIM: self._volume_trim,
            JobKind.SHA256: self._sha256,
            JobKind.COMPRESS: self._transform,
            JobKind.DECOMPRESS: self._transform,
            JobKind.ENCRYPT: self._transform,
            JobKind.DECRYPT: self._transform,
        }

    async def run(self, job: JobRecord) -> None:
        """Execute the job, recording progress on it; raise a domain error if it fails."""
        buffer = await self._pool.acquire()
        try:
            await self._kinds[job.kind](job, buffer)
        finally:
            self._pool.give_back(buffer)

    @property
    def store(self) -> VolumeStore:
        """The volume store (volume kinds only)."""
        if self._store is None:
            raise FailedPrecondition("this agent has no volume store")
        return self._store

    def _owned_volume(self, volume_id: str) -> str:
        """The volume id, if the volume is the session tenant's (called in the I/O thread).

        Attaching checked the owner already; this catches a volume deleted and made
        again by another tenant under the same id while a session held its handle.
        """
        if self.store.get(volume_id).tenant != self._tenant:
            raise NotFound(f"volume {volume_id!r} does not exist")
        return volume_id

    def _write(self, volume_id: str, offset: int, view: memoryview) -> None:
        self.store.write(self._owned_volume(volume_id), offset, view)

    def _read(self, volume_id: str, offset: int, size: int) -> bytes:
        return self.store.read(self._owned_volume(volume_id), offset, size)

    def _flush(self, volume_id: str) -> None:
        self.store.flush(self._owned_volume(volume_id))

    def _trim(self, volume_id: str, offset: int, length: int) -> None:
        self.store.trim(self._owned_volume(volume_id), offset, length)

    async def _volume_write(self, job: JobRecord, buffer: Region) -> None:
        if delay := self.store.throttle(job.volume_id, "write", job.source.length):  # QoS
            await asyncio.sleep(delay)
        async for offset, view in self._read_all(job, buffer):
            await asyncio.to_thread(self._write, job.volume_id, job.offset + offset, view)
        if job.fua:
            await asyncio.to_thread(self._flush, job.volume_id)

    async def _volume_read(self, job: JobRecord, buffer: Region) -> None:
        dst, out = job.destination, job.progress
        if delay := self.store.throttle(job.volume_id, "read", dst.length):  # QoS
            await asyncio.sleep(delay)
        for offset, size in self._chunks(dst.length):
            self._checkpoint(job)
            data = await asyncio.to_thread(self._read, job.volume_id, job.offset + offset, size)
            buffer.view[:size] = data
            await self._transport.write(buffer, 0, size, dst.addr + offset, dst.rkey)
            out.bytes_written += size

    async def _sha256(self, job: JobRecord, buffer: Region) -> None:
        digest = hashlib.sha256()
        async for _, view in self._read_all(job, buffer):
            digest.update(view)
        job.digest = digest.digest()
        await self._write_all(job, buffer, job.digest)

    async def _transform(self, job: JobRecord, buffer: Region) -> None:
        data = bytearray()
        async for _, view in self._read_all(job, buffer):
            data += view
        limit = job.destination.length
        if job.kind == JobKind.COMPRESS:
            out = await asyncio.to_thread(compute.compress, job.parameter, data)
        elif job.kind == JobKind.DECOMPRESS:
            out = await asyncio.to_thread(compute.decompress, job.parameter, data, limit)
        elif job.kind == JobKind.ENCRYPT:
            out = await asyncio.to_thread(compute.encrypt, job.key, data)
        else:
            out = await asyncio.to_thread(compute.decrypt, job.key, data)
        await self._write_all(job, buffer, out)

    async def _read_all(
        self, job: JobRecord, buffer: Region
    ) -> AsyncIterator[tuple[int, memoryview]]:
        """The source, chunk by chunk through the staging buffer, as (offset, bytes).

        Each chunk is valid until the next one is read into the same buffer.
        """
        src = job.source
        for offset, size in self._chunks(src.length):
            self._checkpoint(job)
            await self._transport.read(buffer, 0, size, src.addr + offset, src.rkey)
            job.progress.bytes_read += size
            yield offset, buffer.view[:size]

    async def _write_all(self, job: JobRecord, buffer: Region, data: bytes) -> None:
        """WRITE `data` to the start of the destination; the result is its size."""
        dst = job.destination
        if len(data) > dst.length:
            raise InvalidArgument(
                f"{job.kind.name.lower()}: the output ({len(data)} bytes) does not fit the "
                f"destination ({dst.length} bytes)"
            )
        for offset, size in self._chunks(len(data)):
            self._checkpoint(job)
            buffer.view[:size] = data[offset : offset + size]
            await self._transport.write(buffer, 0, size, dst.addr + offset, dst.rkey)
            job.progress.bytes_written += size
        job.progress.result = len(data)

    async def _volume_flush(self, job: JobRecord, _buffer: Region) -> None:
        self._checkpoint(job)
        await asyncio.to_thread(self._flush, job.volume_id)

    async def _volume_trim(self, job: JobRecord, _buffer: Region) -> None:
        self._checkpoint(job)
        await asyncio.to_thread(self._trim, job.volume_id, job.offset, job.length)

    def _checkpoint(self, job: JobRecord) -> None:
        if job.cancel_requested:
            raise Cancelled("cancelled by request")
        if time.monotonic() > job.deadline:
            raise DeadlineExceeded("job deadline exceeded")

    def _chunks(self, length: int) -> list[tuple[int, int]]:
        step = self._pool.chunk
        return [(off, min(step, length - off)) for off in range(0, length, step)]

    async def _copy(self, job: JobRecord, buffer: Region) -> None:
        dst = job.destination
        async for offset, view in self._read_all(job, buffer):
            await self._transport.write(buffer, 0, len(view), dst.addr + offset, dst.rkey)
            job.progress.bytes_written += len(view)

    async def _crc32c(self, job: JobRecord, buffer: Region) -> None:
        crc = 0
        async for _, view in self._read_all(job, buffer):
            crc = crc32c.crc32c(view, value=crc)
        job.progress.result = crc

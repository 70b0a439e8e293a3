"""JobService: the slow path for jobs (SubmitJob) and the completion stream.

Jobs live in their session, so they share its owner: another tenant's jobs answer
NOT_FOUND as missing ones do. A job names regions of its own session only, and
volumes attached to its session only (AttachVolume checks the volume's tenant).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dpu_agent import paging
from dpu_agent.dataplane.jobs import Origin
from dpu_agent.dataplane.session import VolumeTarget
from dpu_agent.errors import InvalidArgument, ResourceExhausted, Unavailable
from dpu_agent.services import convert
from dpu_agent.services.sessions import owned_session
from dpu_wire import capsule, names
from dpu_wire.capsule import JobKind, Span
from dpu_wire.v1 import job_pb2, job_pb2_grpc

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    import grpc

    from dpu_agent.dataplane.manager import SessionManager
    from dpu_agent.dataplane.session import Session
    from dpu_wire.v1 import common_pb2

_ORIGINS = {job_pb2.JOB_ORIGIN_CAPSULE: Origin.CAPSULE, job_pb2.JOB_ORIGIN_RPC: Origin.GRPC}


def _span(session: Session, ref: common_pb2.RegionRef, what: str) -> Span:
    region = convert.region_id(session, ref.region, f"{what}.region")
    return session.regions.span_of(region, ref.offset, ref.length, what)


def _volume(session: Session, name: str, what: str) -> str:
    volume_id = convert.resource_id(name, "volumes", f"{what}.volume")
    session.check_attached(volume_id)
    return volume_id


_COMPUTE: dict[str, JobKind] = {
    "sha256": JobKind.SHA256,
    "compress": JobKind.COMPRESS,
    "decompress": JobKind.DECOMPRESS,
    "encrypt": JobKind.ENCRYPT,
    "decrypt": JobKind.DECRYPT,
}


def _compute_fields(session: Session, spec: job_pb2.JobSpec, kind: str) -> tuple[Span, Span, int]:
    """(source, destination, parameter) of a compute JobSpec."""
    job = getattr(spec, kind)
    where = f"spec.{kind}"
    src = _span(session, job.source, f"{where}.source")
    dst = _span(session, job.destination, f"{where}.destination")
    parameter = 0
    if kind in ("compress", "decompress"):
        parameter = int(job.format)
    elif kind in ("encrypt", "decrypt"):
        parameter = int(job.key_handle)
    return src, dst, parameter


def _job_fields(
    session: Session, spec: job_pb2.JobSpec
) -> tuple[JobKind, Span, Span, VolumeTarget | None]:
    """(kind, source span, destination span, volume target) of a non-compute JobSpec."""
    kind = spec.WhichOneof("kind")
    where = f"spec.{kind}"
    if kind == "copy":
        src = _span(session, spec.copy.source, f"{where}.source")
        return (
            JobKind.COPY,
            src,
            _span(session, spec.copy.destination, f"{where}.destination"),
            None,
        )
    if kind == "crc32c":
        return JobKind.CRC32C, _span(session, spec.crc32c.source, f"{where}.source"), Span(), None
    if kind == "volume_write":
        w = spec.volume_write
        target = VolumeTarget(_volume(session, w.volume, where), w.offset, fua=w.fua)
        return JobKind.VOLUME_WRITE, _span(session, w.source, f"{where}.source"), Span(), target
    if kind == "volume_read":
        r = spec.volume_read
        target = VolumeTarget(_volume(session, r.volume, where), r.offset)
        dst = _span(session, r.destination, f"{where}.destination")
        return JobKind.VOLUME_READ, Span(), dst, target
    if kind == "volume_flush":
        target = VolumeTarget(_volume(session, spec.volume_flush.volume, where))
        return JobKind.VOLUME_FLUSH, Span(), Span(), target
    if kind == "volume_trim":
        t = spec.volume_trim
        target = VolumeTarget(_volume(session, t.volume, where), t.offset, t.length)
        return JobKind.VOLUME_TRIM, Span(), Span(), target
    raise InvalidArgument(
        "spec: a job kind is required (copy, crc32c, volume_write, volume_read, "
        "volume_flush, volume_trim, sha256, compress, decompress, encrypt, decrypt)"
    )


MAX_DEADLINE_S = capsule.U32_MAX // 1000
"""The longest deadline a job may ask for: what a SUBMIT capsule can carry (~49 days)."""


def _deadline(spec: job_pb2.JobSpec) -> float:
    """spec.deadline in seconds (0: the agent's default), refused when out of range."""
    seconds, nanos = spec.deadline.seconds, spec.deadline.nanos
    if not 0 <= seconds <= MAX_DEADLINE_S or not 0 <= nanos < 1_000_000_000:
        raise InvalidArgument(
            f"spec.deadline must be 0 to {MAX_DEADLINE_S} s (nanos 0 to 999999999), "
            f"not {seconds} s {nanos} ns"
        )
    return seconds + nanos / 1e9


def _job_id(name: str) -> tuple[str, int]:
    session_id, job = names.parse_name(name, "sessions", "jobs")
    if not job.isdigit():
        raise InvalidArgument(f"{name}: job ids are numbers")
    return f"sessions/{session_id}", int(job)


class JobService(job_pb2_grpc.JobServiceServicer):
    """Thin gRPC layer over the sessions' job queues."""

    def __init__(self, manager: SessionManager) -> None:
        self._manager = manager

    async def SubmitJob(
        self, request: job_pb2.SubmitJobRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> job_pb2.Job:
        """Queue a job on a session."""
        session = owned_session(self._manager, request.session)
        spec = request.spec
        kind_name = spec.WhichOneof("kind") or ""
        parameter = 0
        if kind_name in _COMPUTE:
            kind, volume = _COMPUTE[kind_name], None
            source, destination, parameter = _compute_fields(session, spec, kind_name)
        else:
            kind, source, destination, volume = _job_fields(session, spec)
        record = await session.submit(
            kind,
            source,
            destination,
            volume=volume,
            parameter=parameter,
            deadline=_deadline(spec),
            request_id=request.request_id,
            wait_for_slot=request.wait_for_slot,
        )
        return convert.job(session, record, spec)

    async def GetJob(
        self, request: job_pb2.GetJobRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> job_pb2.Job:
        """One open or retained job."""
        session_name, job_id = _job_id(request.name)
        session = owned_session(self._manager, session_name)
        return convert.job(session, session.job(job_id))

    async def ListJobs(
        self, request: job_pb2.ListJobsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> job_pb2.ListJobsResponse:
        """A page of a session's open and retained jobs, by id."""
        session = owned_session(self._manager, request.session)
        jobs = [j for j in session.jobs() if not request.state or int(j.state) == request.state]
        page, token = paging.page(
            jobs, lambda j: f"{j.job_id:020d}", request.page_size, request.page_token
        )
        return job_pb2.ListJobsResponse(
            jobs=[convert.job(session, j) for j in page], next_page_token=token
        )

    async def CancelJob(
        self, request: job_pb2.CancelJobRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> job_pb2.Job:
        """Ask a job to stop."""
        session_name, job_id = _job_id(request.name)
        session = owned_session(self._manager, session_name)
        return convert.job(session, session.cancel(job_id))

    async def WatchCompletions(
        self,
        request: job_pb2.WatchCompletionsRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[job_pb2.Completion]:
        """One completion per job of the session, in completion order, until it closes."""
        session = owned_session(self._manager, request.session)
        origin = _ORIGINS.get(request.origin)
        watcher = session.watch(include_retained=request.include_retained, origin=origin)
        try:
            await context.send_initial_metadata(())  # tells the client the watch is in place
            while True:
                record = await watcher.queue.get()
                if record is None:
                    break
                yield convert.completion(session, record)
                if watcher.overflowed:
                    raise ResourceExhausted(
                        "this stream fell too far behind; watch again with include_retained"
                    )
            if session.error is not None:
                raise Unavailable(session.error[1])
        finally:
            session.unwatch(watcher)

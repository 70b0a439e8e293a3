"""JobService: the slow path for jobs (SubmitJob) and the completion stream.

Jobs live in their session, so they share its owner: another tenant's jobs answer
NOT_FOUND as missing ones do. A job names regions of its own session only, and
volumes attached to its session only (AttachVolume checks the volume's tenant).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dpu_agent import paging
from dpu_agent.dataplane.admission import JobRequest
from dpu_agent.dataplane.bus import WATCHER_BACKLOG
from dpu_agent.dataplane.jobs import Origin
from dpu_agent.errors import InvalidArgument, ResourceExhausted, Unavailable
from dpu_agent.services import convert
from dpu_agent.services.sessions import owned_session
from dpu_wire import capsule, names
from dpu_wire.capsule import ZERO_SPAN, Span
from dpu_wire.jobkinds import BY_FIELD, FLAG_FUA, Handle
from dpu_wire.v1 import job_pb2, job_pb2_grpc

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    import grpc

    from dpu_agent.dataplane.manager import SessionManager
    from dpu_agent.dataplane.session import Session
    from dpu_wire.v1 import common_pb2

_ORIGINS = {job_pb2.JOB_ORIGIN_CAPSULE: Origin.CAPSULE, job_pb2.JOB_ORIGIN_RPC: Origin.GRPC}
_KIND_NAMES = ", ".join(BY_FIELD)


def _span(session: Session, ref: common_pb2.RegionRef, what: str) -> Span:
    region = convert.region_id(session, ref.region, f"{what}.region")
    return session.regions.span_of(region, ref.offset, ref.length, what)


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


def job_request(session: Session, spec: job_pb2.JobSpec) -> JobRequest:
    """The SUBMIT fields of a JobSpec, by the job-kind table (`dpu_wire.jobkinds`).

    Region references become spans; a volume name becomes the session's attachment
    handle (it must be attached); a codec or key handle goes in `handle`.
    """
    field = spec.WhichOneof("kind") or ""
    row = BY_FIELD.get(field)
    if row is None:
        raise InvalidArgument(f"spec: a job kind is required ({_KIND_NAMES})")
    job: Any = getattr(spec, field)
    where = f"spec.{field}"
    source = _span(session, job.source, f"{where}.source") if row.source else ZERO_SPAN
    destination = (
        _span(session, job.destination, f"{where}.destination") if row.destination else ZERO_SPAN
    )
    handle = 0
    if row.handle is Handle.VOLUME:
        volume_id = convert.resource_id(job.volume, "volumes", f"{where}.volume")
        handle = session.handle_of(volume_id)
    elif row.handle is Handle.CODEC:
        handle = int(job.format)
    elif row.handle is Handle.KEY:
        handle = int(job.key_handle)
    flags = FLAG_FUA if row.flags & FLAG_FUA and job.fua else 0
    return JobRequest(
        session.next_job_id(),
        row.kind,
        source,
        destination,
        _deadline(spec),
        offset=int(job.offset) if row.offset else 0,
        handle=handle,
        length=int(job.length) if row.length else 0,
        flags=flags,
    )


def _job_id(name: str) -> tuple[str, int]:
    """The session's name and the job id of "sessions/{session}/jobs/{job}".

    The job id is canonical decimal: `.../jobs/07` is refused, not taken for job 7.
    """
    try:
        session_id, job = names.parse_name(name, "sessions", "jobs")
        return f"sessions/{session_id}", names.parse_number(job, "job id")
    except names.InvalidNameError as exc:
        raise InvalidArgument(f"{name}: {exc}") from None


class JobService(job_pb2_grpc.JobServiceServicer):
    """Thin gRPC layer over the sessions' job queues."""

    def __init__(self, manager: SessionManager) -> None:
        self._manager = manager

    async def SubmitJob(
        self, request: job_pb2.SubmitJobRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> job_pb2.Job:
        """Queue a job on a session."""
        session = owned_session(self._manager, request.session)
        session.check_accepting()
        record = await session.submit(
            job_request(session, request.spec),
            request_id=request.request_id,
            wait_for_slot=request.wait_for_slot,
        )
        return convert.job(session, record, request.spec)

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
        page, token = paging.page(jobs, lambda j: f"{j.job_id:020d}", request)
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
                    f"this stream fell {WATCHER_BACKLOG} completions behind; "
                    "watch again with include_retained"
                )
            if session.error is not None:
                raise Unavailable(session.error[1])
        finally:
            session.unwatch(watcher)

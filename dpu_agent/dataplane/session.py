"""A session: one host's data plane, its regions, its job queue and its completions.

Jobs arrive two ways: as SUBMIT capsules on the data plane (the fast path, answered
with a COMPLETION capsule) or through JobService.SubmitJob (the slow path). Either
way a job finishes exactly once (`JobRecord.finish`), and every finished job is
handed to the session's watchers (WatchCompletions streams) and event sinks.

Job ids: the host picks ids below 2**63 for its capsules; the agent numbers the jobs
it receives through gRPC from 2**63 up, so the two never collide.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import itertools
import logging
import time
from typing import TYPE_CHECKING, Final

from dpu_agent import request_context, status
from dpu_agent.dataplane import compute
from dpu_agent.dataplane.jobs import (
    JobRecord,
    JobRunner,
    JobState,
    Origin,
    StagingPool,
    check_spans,
)
from dpu_agent.dataplane.regions import RegionTable
from dpu_agent.errors import (
    AgentError,
    Cancelled,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from dpu_wire import capsule
from dpu_wire.capsule import CapsuleError, JobKind, Span, State
from dpu_wire.transport.base import PeerClosed, TransportError

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

    from dpu_agent.metrics import AgentMetrics
    from dpu_agent.storage import VolumeStore
    from dpu_wire.transport.base import AgentTransport, PeerAddress

log = logging.getLogger(__name__)

WATCHER_BACKLOG: Final = 65536
MAX_WATCHERS: Final = 16  # WatchCompletions streams per session (the SDK holds one)
MAX_ATTACHED_VOLUMES: Final = 1024
MAX_KEYS: Final = 256
KEYED_KINDS: Final = frozenset({JobKind.ENCRYPT, JobKind.DECRYPT})


@dataclasses.dataclass(frozen=True)
class VolumeTarget:
    """Where a volume job acts: the volume, a byte offset, a length (trim), FUA (write)."""

    volume_id: str = ""
    offset: int = 0
    length: int = 0
    fua: bool = False


class SessionState(enum.IntEnum):
    """dpu.v1.SessionState numbers."""

    CONNECTING = 1
    ACTIVE = 2
    CLOSING = 3
    CLOSED = 4
    FAILED = 5


@dataclasses.dataclass(frozen=True)
class SessionSettings:
    """Per-session limits and defaults."""

    queue_depth: int = 32
    chunk_size: int = 1 << 20
    default_deadline: float = 60.0
    retained: int = 1024


@dataclasses.dataclass
class SessionCounters:
    """64-bit counters of one session."""

    jobs_submitted: int = 0
    jobs_completed: int = 0
    jobs_failed: int = 0
    bytes_read: int = 0
    bytes_written: int = 0


class Watcher:
    """One WatchCompletions stream: a queue of finished jobs, None at the end."""

    def __init__(self, origin: Origin | None = None) -> None:
        self.queue: asyncio.Queue[JobRecord | None] = asyncio.Queue()
        self.origin = origin
        self.overflowed = False

    def put(self, job: JobRecord | None) -> None:
        """Queue a finished job (or the end marker); mark overflow instead of growing forever."""
        if job is not None and self.origin is not None and job.origin != self.origin:
            return
        if job is not None and self.queue.qsize() >= WATCHER_BACKLOG:
            self.overflowed = True
            return
        self.queue.put_nowait(job)


class Session:
    """The agent side of one host session."""

    def __init__(  # noqa: PLR0913 - the session's identity and its parts
        self,
        session_id: str,
        *,
        tenant: str,
        label: str,
        transport_kind: int,
        transport: AgentTransport,
        settings: SessionSettings,
        on_completion: Callable[[Session, JobRecord], None] | None = None,
        store: VolumeStore | None = None,
        metrics: AgentMetrics | None = None,
    ) -> None:
        self.session_id = session_id
        # made inside OpenSession: its x-request-id, carried by the capsule jobs' events
        self.open_request_id = request_context.request_id.get()
        self._metrics = metrics
        self.host_gone = False  # the data plane failed because the host closed its end
        self.name = f"sessions/{session_id}"
        self.tenant = tenant
        self.label = label
        self.transport_kind = transport_kind
        self.transport = transport
        self.settings = settings
        self.state = SessionState.CONNECTING
        self.error: tuple[int, str] | None = None
        self.create_ns = time.time_ns()
        self.regions = RegionTable()
        self.counters = SessionCounters()
        self._on_completion = on_completion
        self._open: dict[int, JobRecord] = {}
        self._retained: collections.OrderedDict[int, JobRecord] = collections.OrderedDict()
        self._by_request: dict[str, int] = {}
        self._slots = asyncio.Semaphore(settings.queue_depth)
        self._grpc_ids = itertools.count(capsule.AGENT_JOB_ID_BASE)
        self._watchers: set[Watcher] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._pool: StagingPool | None = None
        self._runner: JobRunner | None = None
        self._capsule_task: asyncio.Task[None] | None = None
        self.unwatched_since: float | None = time.monotonic()
        self.accepting = True  # False while the agent drains for shutdown
        self._store = store
        self._volumes: dict[int, str] = {}  # capsule handle -> volume id
        self._handles: dict[str, int] = {}
        self._next_handle = itertools.count(1)
        self._keys: dict[int, bytes] = {}  # encrypt/decrypt key handle -> key (memory only)
        self._next_key = itertools.count(1)
        self._idle = asyncio.Event()  # set while no job is open
        self._idle.set()

    # ------------------------------------------------------------------ lifecycle
    async def connect(self, host: PeerAddress) -> None:
        """Connect the data plane to the host and start taking capsules."""
        await self.transport.connect(host)
        self._pool = StagingPool(
            self.transport, self.settings.chunk_size, self.settings.queue_depth
        )
        self._runner = JobRunner(self.transport, self._pool, self._store, tenant=self.tenant)
        self._capsule_task = asyncio.create_task(self._capsule_loop(), name=f"{self.name}/capsules")
        self.state = SessionState.ACTIVE

    async def close(self, reason: str = "session closed") -> None:
        """Cancel open jobs, destroy the data plane, forget regions. Idempotent."""
        if self.state in (SessionState.CLOSING, SessionState.CLOSED):
            return
        failed = self.state == SessionState.FAILED
        self.state = SessionState.CLOSING
        await self._shutdown(State.CANCELLED, status.CANCELLED, reason)
        self.state = SessionState.FAILED if failed else SessionState.CLOSED

    async def _fail(self, exc: BaseException) -> None:
        if self.state not in (SessionState.ACTIVE, SessionState.CONNECTING):
            return
        message = f"data plane failed: {exc}"
        log.warning("session failed", extra={"session": self.name, "error": str(exc)})
        self.state = SessionState.FAILED
        self.error = (status.UNAVAILABLE, message)
        self.host_gone = isinstance(exc, PeerClosed)
        if self._metrics is not None and not self.host_gone:
            self._metrics.dataplane_failed(self.transport_kind)
        await self._shutdown(State.FAILED, status.UNAVAILABLE, message)

    async def _shutdown(self, state: State, code: int, reason: str) -> None:
        for job in list(self._open.values()):
            job.cancel_requested = True
            completion = job.finish(state, code, reason)
            if completion is not None:
                self._publish(job)
        await self.transport.close()  # pending RDMA ops fail, so job tasks end
        current = asyncio.current_task()
        tasks = [
            t for t in (*self._tasks, self._capsule_task) if t is not None and t is not current
        ]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._pool is not None:
            self._pool.close()
        for watcher in self._watchers:
            watcher.put(None)
        self.regions = RegionTable()
        self._keys.clear()

    @property
    def active(self) -> bool:
        """Whether the session takes jobs."""
        return self.state == SessionState.ACTIVE

    def _require_active(self) -> None:
        if not self.active:
            detail = f": {self.error[1]}" if self.error else ""
            raise FailedPrecondition(f"{self.name} is {self.state.name}{detail}")
        if not self.accepting:
            raise Unavailable("the agent is shutting down and takes no new jobs")

    # ------------------------------------------------------------------ jobs
    @property
    def queue_depth(self) -> int:
        """Maximum number of open jobs."""
        return self.settings.queue_depth

    @property
    def open_jobs(self) -> int:
        """Jobs admitted and not finished."""
        return len(self._open)

    async def submit(  # noqa: PLR0913 - a job's fields
        self,
        kind: JobKind,
        source: Span,
        destination: Span,
        *,
        volume: VolumeTarget | None = None,
        parameter: int = 0,
        deadline: float = 0.0,
        request_id: str = "",
        wait_for_slot: bool = False,
    ) -> JobRecord:
        """Queue a job from the gRPC path (idempotent on request_id)."""
        self._require_active()
        if request_id and request_id in self._by_request:
            return self.job(self._by_request[request_id])
        target = volume or VolumeTarget()
        job = JobRecord(
            job_id=next(self._grpc_ids),
            kind=kind,
            source=source,
            destination=destination,
            origin=Origin.GRPC,
            deadline=time.monotonic() + (deadline or self.settings.default_deadline),
            request_id=request_id,
            rpc_request_id=request_context.request_id.get(),
            volume_id=target.volume_id,
            offset=target.offset,
            length=target.length,
            fua=target.fua,
            parameter=parameter,
            key=self._keys.get(parameter, b"") if kind in KEYED_KINDS else b"",
        )
        check_spans(job, self.regions)
        if self._slots.locked() and not wait_for_slot:
            raise ResourceExhausted(
                f"{self.name}: all {self.queue_depth} queue slots are in use; "
                "retry, or set wait_for_slot"
            )
        await self._slots.acquire()
        self._require_active()
        if request_id:
            self._by_request[request_id] = job.job_id
        self._start(job)
        return job

    def job(self, job_id: int) -> JobRecord:
        """An open or retained job."""
        job = self._open.get(job_id) or self._retained.get(job_id)
        if job is None:
            raise NotFound(f"{self.name}/jobs/{job_id} does not exist (or is no longer retained)")
        return job

    def jobs(self) -> list[JobRecord]:
        """Open and retained jobs, by id."""
        return sorted([*self._open.values(), *self._retained.values()], key=lambda j: j.job_id)

    def cancel(self, job_id: int) -> JobRecord:
        """Ask a job to stop; it completes CANCELLED unless it finishes first."""
        job = self.job(job_id)
        job.cancel_requested = True
        return job

    async def wait_idle(self) -> None:
        """Wait until no job is open."""
        await self._idle.wait()

    def _start(self, job: JobRecord) -> None:
        self._idle.clear()
        self._open[job.job_id] = job
        self.counters.jobs_submitted += 1
        task = asyncio.create_task(self._execute(job), name=f"{self.name}/jobs/{job.job_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _execute(self, job: JobRecord) -> None:
        assert self._runner is not None  # noqa: S101 - set by connect()
        try:
            if job.cancel_requested:
                raise Cancelled("cancelled before it started")  # noqa: TRY301
            job.start()
            await self._runner.run(job)
            job.finish(State.SUCCEEDED)
        except Cancelled as exc:
            job.finish(State.CANCELLED, status.CANCELLED, str(exc))
        except AgentError as exc:
            job.finish(State.FAILED, status.code_for(exc), str(exc))
        except TransportError as exc:
            job.finish(State.FAILED, status.UNAVAILABLE, f"data plane failed: {exc}")
            self._spawn(self._fail(exc))
        except asyncio.CancelledError:
            job.finish(State.CANCELLED, status.CANCELLED, "session closed")
            raise
        except Exception:
            log.exception("job failed unexpectedly", extra={"job": job.job_id})
            job.finish(State.FAILED, status.code_for(RuntimeError()), "internal error")
        finally:
            self._slots.release()
            await self._deliver(job)

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _deliver(self, job: JobRecord) -> None:
        """Publish a finished job and, for capsule jobs, SEND its completion."""
        if self._open.get(job.job_id) is not job:
            return  # already delivered by _shutdown
        self._publish(job)
        completion = job.completion
        if job.origin == Origin.CAPSULE and completion is not None and self.active:
            try:
                await self.transport.send(completion.encode())
            except TransportError as exc:
                await self._fail(exc)

    def _publish(self, job: JobRecord) -> None:
        self._open.pop(job.job_id, None)
        if not self._open:
            self._idle.set()
        self._retained[job.job_id] = job
        while len(self._retained) > self.settings.retained:
            old_id, old = self._retained.popitem(last=False)
            if old.request_id and self._by_request.get(old.request_id) == old_id:
                del self._by_request[old.request_id]
        counters = self.counters
        if job.state == JobState.SUCCEEDED:
            counters.jobs_completed += 1
        else:
            counters.jobs_failed += 1
        counters.bytes_read += job.progress.bytes_read
        counters.bytes_written += job.progress.bytes_written
        for watcher in self._watchers:
            watcher.put(job)
        if self._metrics is not None:
            self._metrics.job_finished(job, self.transport_kind)
        if self._on_completion is not None:
            self._on_completion(self, job)

    # ------------------------------------------------------------------ capsules
    async def _capsule_loop(self) -> None:
        try:
            while True:
                data = await self.transport.recv()
                try:
                    message = capsule.decode(data)
                except CapsuleError as exc:
                    await self._reject(exc.job_id, status.INVALID_ARGUMENT, f"bad capsule: {exc}")
                    continue
                if isinstance(message, capsule.Submit):
                    await self._on_submit(message)
                elif isinstance(message, capsule.Cancel):
                    if message.job_id in self._open:
                        self._open[message.job_id].cancel_requested = True
                else:
                    await self._reject(
                        message.job_id,
                        status.INVALID_ARGUMENT,
                        "bad capsule: hosts do not send COMPLETION",
                    )
        except TransportError as exc:
            await self._fail(exc)

    async def _reject(self, job_id: int, code: int, message: str) -> None:
        """Answer a capsule that does not make a job (undecodable, duplicate id)."""
        if self._metrics is not None:
            self._metrics.capsule_rejected()
        reply = capsule.Completion(job_id=job_id, state=State.FAILED, status=code, message=message)
        await self.transport.send(reply.encode())

    async def _on_submit(self, sub: capsule.Submit) -> None:
        if sub.job_id >= capsule.AGENT_JOB_ID_BASE:
            await self._reject(
                sub.job_id, status.INVALID_ARGUMENT, "job ids >= 2**63 are the agent's"
            )
            return
        if sub.job_id in self._open:
            await self._reject(
                sub.job_id, status.INVALID_ARGUMENT, f"job id {sub.job_id} is in use"
            )
            return
        deadline = sub.deadline_ms / 1000 if sub.deadline_ms else self.settings.default_deadline
        job = JobRecord(
            job_id=sub.job_id,
            kind=sub.kind,
            source=sub.source,
            destination=sub.destination,
            origin=Origin.CAPSULE,
            deadline=time.monotonic() + deadline,
            rpc_request_id=self.open_request_id,
            volume_id=self._volumes.get(sub.handle, ""),
            offset=sub.offset,
            length=sub.length,
            fua=bool(sub.flags & capsule.FLAG_FUA),
            parameter=sub.handle,
            key=self._keys.get(sub.handle, b"") if sub.kind in KEYED_KINDS else b"",
        )
        try:
            self._require_active()
            if sub.kind in capsule.VOLUME_KINDS and sub.handle not in self._volumes:
                raise InvalidArgument(
                    f"no volume is attached to this session with handle {sub.handle}"
                )
            check_spans(job, self.regions)
            if self._slots.locked():
                raise ResourceExhausted(
                    f"all {self.queue_depth} queue slots are in use (the host exceeded its credits)"
                )
        except AgentError as exc:
            self._open[job.job_id] = job
            job.finish(State.FAILED, status.code_for(exc), str(exc))
            await self._deliver(job)
            return
        await self._slots.acquire()
        self._start(job)

    # ------------------------------------------------------------------ volumes
    async def attach(self, volume_id: str) -> int:
        """The handle capsules use for a volume (the same one if already attached).

        Only a volume of the session's own tenant attaches; another tenant's answers
        NotFound, as a missing one does.
        """
        self._require_active()
        if volume_id in self._handles:
            return self._handles[volume_id]
        if self._store is None:
            raise FailedPrecondition("this agent has no volume store")
        info = await asyncio.to_thread(self._store.get, volume_id)  # NotFound if it is missing
        if info.tenant != self.tenant:
            raise NotFound(f"volume {volume_id!r} does not exist")
        if len(self._volumes) >= MAX_ATTACHED_VOLUMES:
            raise ResourceExhausted(f"a session attaches at most {MAX_ATTACHED_VOLUMES} volumes")
        handle = next(self._next_handle)
        self._volumes[handle] = volume_id
        self._handles[volume_id] = handle
        return handle

    def check_attached(self, volume_id: str) -> None:
        """FailedPrecondition unless the volume is attached (jobs name attached volumes only)."""
        if volume_id not in self._handles:
            raise FailedPrecondition(
                f"volumes/{volume_id} is not attached to {self.name} (AttachVolume first)"
            )

    def detach(self, volume_id: str) -> None:
        """Remove a volume's handle from the session."""
        handle = self._handles.pop(volume_id, None)
        if handle is None:
            raise NotFound(f"volumes/{volume_id} is not attached to {self.name}")
        del self._volumes[handle]

    def register_key(self, key: bytes) -> int:
        """A handle for an AES key, for this session's encrypt and decrypt jobs."""
        self._require_active()
        compute.check_key(key)
        if len(self._keys) >= MAX_KEYS:
            raise ResourceExhausted(f"a session registers at most {MAX_KEYS} keys")
        handle = next(self._next_key)
        self._keys[handle] = key
        return handle

    # ------------------------------------------------------------------ watchers
    def watch(self, *, include_retained: bool, origin: Origin | None = None) -> Watcher:
        """A new watcher of finished jobs (ended at once if the session is over)."""
        if len(self._watchers) >= MAX_WATCHERS:
            raise ResourceExhausted(f"{self.name} is watched by {MAX_WATCHERS} streams already")
        watcher = Watcher(origin)
        if include_retained:
            for job in self._retained.values():
                watcher.put(job)
        if not self.active:
            watcher.put(None)
        self._watchers.add(watcher)
        self.unwatched_since = None
        return watcher

    def unwatch(self, watcher: Watcher) -> None:
        """Forget a watcher; with none left, the orphan clock starts."""
        self._watchers.discard(watcher)
        if not self._watchers:
            self.unwatched_since = time.monotonic()

"""A session's job pipeline on the reactor thread: capsules in, jobs run, completions out.

Everything here runs on the reactor thread (`reactor.Reactor`), which owns the
session's link. Capsules are decoded straight from the receive buffer, admitted
(`admission.admit`, the path SubmitJob jobs take too), given staging buffers and run:
each job is a generator from `runners` that the pipeline resumes as its operations
complete. Two kinds of small inline job skip the generator: a CRC-32C is one call
(`runners.immediate`), a non-durable volume write one entry of the pass's batch of
store writes (`runners.queued_write`). A finished job frees its queue slot, its
COMPLETION is posted (capsule jobs; after the job's last WRITE, which RC ordering
lands first), and at the end of the reactor's pass the pass's finished jobs go to the
completion bus and the session's watchers in one batch.

Cancellation and deadlines end a job at once, even with an operation in flight (the
job's buffers stay out of the pool until that operation completes; a worker call of it
that has not started is dropped); deadlines of jobs waiting on something are checked
every `SWEEP_S`.

A job that calls the volume store (`runners.STORAGE_KINDS`) first takes one of the
session's `queue_depth` storage slots, waiting QUEUED (like a job waiting for staging)
while none is free. Its slot comes back once the job ended and its storage call
returned: a job's queue slot frees as soon as it ends, its call may not, and without
this a host that cancels each volume job it sends would queue calls without bound.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from typing import TYPE_CHECKING, Any, Final

from dpu_agent import status
from dpu_agent.dataplane.admission import JobRequest, admit
from dpu_agent.dataplane.jobs import JobRecord, JobState, Origin
from dpu_agent.dataplane.runners import (
    PIPELINED,
    RUNNERS,
    STORAGE_KINDS,
    BatchWrite,
    Io,
    Read,
    Sleep,
    Together,
    Work,
    Write,
    buffers_needed,
    immediate,
    pipelined,
    queued_write,
)
from dpu_agent.errors import (
    AgentError,
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from dpu_wire import capsule
from dpu_wire.capsule import CapsuleError, Opcode, Span, State
from dpu_wire.jobkinds import FLAG_INLINE, JobKind
from dpu_wire.transport.base import (
    CoreDone,
    CoreJob,
    FastJob,
    LinkSink,
    TransportError,
    max_waiting,
)

if TYPE_CHECKING:
    import concurrent.futures
    from collections.abc import Callable, Generator

    from dpu_agent.dataplane.reactor import Reactor, Timer
    from dpu_agent.dataplane.regions import RegionTable
    from dpu_agent.dataplane.runners import Op, Storage
    from dpu_agent.dataplane.staging import Buffer, Staging, Waiter
    from dpu_agent.storage.qos import Reservation
    from dpu_wire.transport.base import AgentLink

log = logging.getLogger(__name__)

SWEEP_S: Final = 0.1  # how often deadlines of waiting jobs are checked
LATE: Final = "job deadline exceeded"  # the message of a job that ends past its deadline
CLOSE_DRAIN_S: Final = 0.5  # how long a closing session waits for its last SENDs
MAX_WAITING: Final = 4096  # SubmitJob requests waiting for a slot, per session


class SessionHooks:
    """What the pipeline tells and asks its session (implemented by `Session`)."""

    def check_accepting(self) -> None:
        """FailedPrecondition unless ACTIVE; Unavailable while the agent drains."""
        raise NotImplementedError

    def volume_of(self, handle: int) -> str | None:
        """The volume attached under `handle`."""
        raise NotImplementedError

    def key_of(self, handle: int) -> bytes | None:
        """The AES key registered under `handle`."""
        raise NotImplementedError

    def finished(self, jobs: list[JobRecord]) -> None:
        """A pass's finished jobs (publish them)."""
        raise NotImplementedError

    def data_plane_failed(self, error: TransportError) -> None:
        """The link failed (the pipeline has already failed every open job)."""
        raise NotImplementedError

    def rejected(self) -> None:
        """A capsule was answered without making a job."""
        raise NotImplementedError

    def ready(self) -> bool:
        """Whether `check_accepting` would pass (asked once per pass by the fast path)."""
        try:
            self.check_accepting()
        except AgentError:
            return False
        return True


class Counters:
    """A session's 64-bit job counters (written on the reactor thread)."""

    __slots__ = (
        "bytes_read",
        "bytes_written",
        "jobs_completed",
        "jobs_failed",
        "jobs_native",
        "jobs_submitted",
    )

    def __init__(self) -> None:
        self.jobs_native = 0  # of jobs_completed: run by the link's native core
        self.jobs_submitted = 0
        self.jobs_completed = 0
        self.jobs_failed = 0
        self.bytes_read = 0
        self.bytes_written = 0


class _Group:
    """The operations of a `Together` not finished yet, and what they gave."""

    __slots__ = ("error", "left", "values")

    def __init__(self, count: int) -> None:
        self.left = count
        self.values: list[object] = [None] * count
        self.error: BaseException | None = None

    def done(self, slot: int | None, value: object, error: BaseException | None) -> bool:
        """One finished (`slot`: a Work's place); True once all have."""
        if slot is not None:
            self.values[slot] = value
        if error is not None and self.error is None:
            self.error = error
        self.left -= 1
        return self.left == 0


class _Waiter:
    """A SubmitJob request waiting for a slot: its job (admitted) and who to answer.

    A retry with the same request_id joins it (one job, every caller answered); a
    caller that goes away (its RPC cancelled, or past its deadline) is withdrawn, and a
    request nobody waits for any more is dropped, never run.
    """

    __slots__ = ("answers", "asked", "job")

    def __init__(
        self,
        job: JobRecord,
        answer: Callable[[JobRecord | BaseException], None],
        asked: JobRequest,
    ) -> None:
        self.job = job
        self.answers = [answer]
        self.asked = asked  # the request as asked (`_asked`): a retry must ask the same

    def answer(self, result: JobRecord | BaseException) -> None:
        for answer in self.answers:
            answer(result)


class _Run:
    """A running job: its generator, its buffers and what it waits for."""

    __slots__ = (
        "buffers",
        "call",
        "gen",
        "group",
        "job",
        "pending",
        "staging_wait",
        "storage_slot",
        "timer",
        "token",
        "waits_for_storage",
    )

    def __init__(self, job: JobRecord, token: int) -> None:
        self.job = job
        self.token = token
        self.gen: Generator[Any, Any, None] | None = None
        self.buffers: list[Buffer] = []
        self.pending = 0  # operations in flight: link operations, worker calls, batch writes
        self.timer: Timer | None = None
        self.group: _Group | None = None  # the Together it waits for
        self.call: concurrent.futures.Future[Any] | None = None  # its worker call
        self.storage_slot = False  # holds one of the session's storage slots
        self.waits_for_storage = False  # in the pipeline's queue for one
        self.staging_wait: Waiter | None = None  # its place in staging's queue


class Pipeline(LinkSink):
    """The reactor-side half of a session (see the module docstring)."""

    def __init__(  # noqa: PLR0913 - the session's parts
        self,
        *,
        hooks: SessionHooks,
        link: AgentLink,
        reactor: Reactor,
        staging: Staging,
        regions: RegionTable,
        storage: Storage | None,
        queue_depth: int,
        default_deadline: float,
        open_request_id: str = "",
        retained: int = 1024,
    ) -> None:
        self._hooks = hooks
        self.link = link
        self._reactor = reactor
        self._staging = staging
        self.regions = regions
        self._storage = storage
        self.queue_depth = queue_depth
        self.default_deadline = default_deadline
        self._open_request_id = open_request_id
        self._retained_max = retained
        self.open: dict[int, JobRecord] = {}
        self.retained: collections.OrderedDict[int, JobRecord] = collections.OrderedDict()
        # SubmitJob's request_id: (its job, the request as asked, `_asked`)
        self.by_request: dict[str, tuple[int, JobRequest]] = {}
        self._runs: dict[int, _Run] = {}  # by token
        self._run_of: dict[int, _Run] = {}  # by job id
        # by job id: writes waiting for their QoS, and the tokens they took
        self._throttled: dict[int, tuple[Timer, Reservation]] = {}
        self._next_token = 1
        self._finished: list[JobRecord] = []
        # this pass's BatchWrites, for one write_batch: a run's, or a whole job's (no run)
        self._writes: list[tuple[JobRecord, _Run | None, BatchWrite]] = []
        self._backlog: collections.deque[tuple[bytes, int | None]] = collections.deque()
        # COMPLETIONs waiting for the link: a host that takes none would grow this for
        # ever, as its jobs' slots free when their COMPLETION is queued (DP-2.6-6)
        self._backlog_max = max_waiting(queue_depth)
        # SubmitJob requests waiting for a slot, in order; those with a request_id by it
        self._waiting: collections.deque[_Waiter] = collections.deque()
        self._waiting_by_request: dict[str, _Waiter] = {}
        # storage slots (see the module docstring): free ones, and runs waiting for one
        self.storage_free = queue_depth
        self._storage_waiting: collections.deque[_Run] = collections.deque()
        self._serving_storage = False
        self._sweeper: Timer | None = None
        self.failed = False
        self.closed = False
        self.counters = Counters()
        self.futile = 0  # capsules that ran no job: the reactor charges them to the tenant
        # The link's fast path (`AgentLink.fast_regions`): it runs COPY jobs itself
        # while every job this session holds open is one it started; the regions are
        # pushed again whenever the table changed (`fast_room`).
        self._fast = link.fast_regions([], self)
        self._fast_version = -1
        self._core: set[int] = set()  # open jobs the link started (`on_core_jobs`)
        if self._fast:
            regions.on_withdraw = self._push_regions

    # ------------------------------------------------------------ LinkOwner

    @property
    def sink(self) -> LinkSink:
        """Where the link's completions and capsules go: here."""
        return self

    def end_pass(self) -> None:
        """Push out what this pass posted and publish the jobs that finished."""
        while self._writes:  # jobs resumed by a batch may gather more (their next chunk)
            self._write_batch()
        if self._backlog:
            self._send_backlog()
        self.link.flush()
        if self._finished:
            batch, self._finished = self._finished, []
            self._hooks.finished(batch)

    def link_failed(self) -> None:
        """The link reported an error."""
        error = self.link.error
        if error is not None:
            self.fail(error)

    def fast_room(self) -> int:
        """FastSink: how many jobs the link may start itself (0 while ours are in flight).

        The queue slots free, when every open job is one the link started (the link
        knows their ids), no SubmitJob waits for a slot, no COMPLETION waits for the
        link and no store write for the pass, the session is ACTIVE and the agent not
        draining: the checks the link does not make itself.
        """
        if (
            len(self.open) != len(self._core)
            or self._waiting
            or self._backlog
            or self._writes
            or self.failed
            or self.closed
            or not self._hooks.ready()
        ):
            return 0
        if self.regions.version != self._fast_version:
            self._push_regions()
        return self.queue_depth - len(self.open)

    def _push_regions(self) -> None:
        """Give the link's fast path the regions as they are now.

        After every change, at the latest at the next poll (`fast_room`); after a
        withdrawal at once, on the control plane's thread (`RegionTable.on_withdraw`),
        under the GIL the link's core holds while it serves: a SUBMIT the host sends
        once WithdrawRegion answered never finds the region in the core's list.
        """
        regions = self.regions
        self._fast_version = regions.version
        self.link.fast_regions(regions.fast_list(), self)

    def on_fast_jobs(self, jobs: list[FastJob], failed: bool) -> None:  # noqa: FBT001 - FastSink's shape
        """FastSink: record the inline COPY jobs the link ran and answered itself.

        Each becomes the JobRecord the pipeline would have made (GetJob, the retained
        jobs, metrics, watch streams and events see no difference); the last one failed
        with the link if `failed` (its COMPLETION was never posted).
        """
        now = time.monotonic()
        default = self.default_deadline
        request_id = self._open_request_id
        c = self.counters
        for job_id, length, dst, rkey, deadline_ms, submit_ns, start_ns, end_ns, _ in jobs:
            job = JobRecord(
                job_id,
                JobKind.COPY,
                Span(0, length, 0),
                Span(dst, length, rkey),
                Origin.CAPSULE,
                now + (deadline_ms / 1000 if deadline_ms else default),
                rpc_request_id=request_id,
                submit_ns=submit_ns,
            )
            job.bytes_read = job.bytes_written = length
            job.finish_at(start_ns, end_ns)
            self._retain(job)
            self._finished.append(job)
        c.jobs_submitted += len(jobs)
        c.jobs_completed += len(jobs)
        c.jobs_native += len(jobs)
        done = sum(job[1] for job in jobs)
        c.bytes_read += done
        c.bytes_written += done
        if failed and jobs:
            last = self._finished[-1]
            last.state, last.status = JobState.FAILED, status.UNAVAILABLE
            last.message = "the data plane failed before the job's COMPLETION was sent"
            c.jobs_completed -= 1
            c.jobs_native -= 1
            c.jobs_failed += 1

    def on_core_jobs(self, jobs: list[CoreJob]) -> None:
        """FastSink: hold open the COPY jobs the link started by READing their source.

        Each is the JobRecord admission would have made, RUNNING: CANCEL, its deadline
        and the session's end find it as any open job (`_end` tells the link).
        """
        now = time.monotonic()
        default = self.default_deadline
        request_id = self._open_request_id
        opened, core = self.open, self._core
        for job_id, length, src, src_rkey, dst, dst_rkey, deadline_ms, submit_ns, start_ns in jobs:
            job = JobRecord(
                job_id,
                JobKind.COPY,
                Span(src, length, src_rkey),
                Span(dst, length, dst_rkey),
                Origin.CAPSULE,
                now + (deadline_ms / 1000 if deadline_ms else default),
                rpc_request_id=request_id,
                submit_ns=submit_ns,
            )
            job.state, job.start_ns = JobState.RUNNING, start_ns
            opened[job_id] = job
            core.add(job_id)
        self.counters.jobs_submitted += len(jobs)
        if self._sweeper is None:
            self._arm_sweeper()  # their deadlines hold while the READ is out

    def on_core_done(self, done: list[CoreDone]) -> None:
        """FastSink: the link answered these jobs of its own (their COMPLETION is posted).

        Each ends as the pipeline would have ended it: SUCCEEDED, or FAILED with
        DEADLINE_EXCEEDED if its deadline had passed when its READ came in. An answer to
        a job the link did not start, or that has ended, means the link and the pipeline
        disagree: this session fails (not the agent, whose other sessions are sound).
        """
        opened, core, c = self.open, self._core, self.counters
        strays = []
        for job_id, end_ns, late in done:
            if job_id not in core:
                strays.append(job_id)
                continue
            job = opened.pop(job_id)
            core.discard(job_id)
            length = job.source.length
            job.bytes_read = length
            if late:
                job.finish(State.FAILED, status.DEADLINE_EXCEEDED, LATE)
                job.end_ns = end_ns
                c.jobs_failed += 1
            else:
                job.bytes_written = length
                job.finish_at(job.start_ns, end_ns)
                c.jobs_completed += 1
                c.jobs_native += 1
                c.bytes_written += length
            c.bytes_read += length
            self._retain(job)
            self._finished.append(job)
        if strays:
            log.error("the native core answered jobs this session does not hold: %s", strays)
            self.fail(TransportError(f"internal error: the link answered unknown jobs {strays}"))
        if self._waiting and len(opened) < self.queue_depth:
            self._serve_waiting()

    # ------------------------------------------------------------ AdmissionContext

    @property
    def inline_max(self) -> int:
        """The largest source a SUBMIT may carry inline: what the link can receive."""
        return self.link.inline_max

    def check_accepting(self) -> None:
        """See `SessionHooks.check_accepting`."""
        self._hooks.check_accepting()

    def volume_of(self, handle: int) -> str | None:
        """See `SessionHooks.volume_of`."""
        return self._hooks.volume_of(handle)

    def key_of(self, handle: int) -> bytes | None:
        """See `SessionHooks.key_of`."""
        return self._hooks.key_of(handle)

    # ------------------------------------------------------------ capsules

    def on_capsule(self, data: memoryview) -> None:
        """A capsule arrived: SUBMIT, CANCEL, or something to refuse."""
        now_ns = time.time_ns()
        try:
            self._dispatch(data, now_ns)
        except CapsuleError as exc:
            self._reject(exc.job_id, f"bad capsule: {exc}", now_ns)

    def _dispatch(self, data: memoryview, now_ns: int) -> None:
        opcode, job_id = capsule.peek_header(data)
        if opcode == Opcode.SUBMIT:
            self._on_submit(capsule.submit_fields(data), data, now_ns)
        elif opcode == Opcode.CANCEL:
            if len(data) != capsule.CANCEL_SIZE:
                raise CapsuleError(
                    f"CANCEL capsule must be {capsule.CANCEL_SIZE} bytes, not {len(data)}", job_id
                )
            if job_id not in self.open:
                self.futile += 1
            self.cancel(job_id, "cancelled by request")
        elif opcode == Opcode.COMPLETION:
            capsule.completion_fields(data)
            self._reject(job_id, "bad capsule: hosts do not send COMPLETION", now_ns)
        else:
            raise CapsuleError(f"unknown opcode {opcode}", job_id)

    def _on_submit(self, f: capsule.SubmitFields, data: memoryview, now_ns: int) -> None:
        job_id = f[0]
        if job_id >= capsule.AGENT_JOB_ID_BASE:
            self._reject(job_id, "job ids >= 2**63 are the agent's", now_ns)
            return
        if job_id in self.open:
            self._reject(job_id, f"job id {job_id} is in use", now_ns)
            return
        inline = bytes(data[capsule.SUBMIT_SIZE :]) if f[2] & FLAG_INLINE else b""
        request = JobRequest(
            job_id, f[1], Span(f[4], f[5], f[6]), Span(f[7], f[8], f[9]),
            f[3] / 1000, f[10], f[11], f[12], f[2], inline,
        )  # fmt: skip
        try:
            job = admit(
                self,
                request,
                Origin.CAPSULE,
                rpc_request_id=self._open_request_id,
                submit_ns=now_ns,
            )
            if len(self.open) >= self.queue_depth:
                raise ResourceExhausted(
                    f"all {self.queue_depth} queue slots are in use (the host exceeded its credits)"
                )
        except AgentError as exc:
            failed = JobRecord(
                job_id, JobKind(f[1]), request.source, request.destination, Origin.CAPSULE, 0.0,
                rpc_request_id=self._open_request_id, submit_ns=now_ns,
            )  # fmt: skip
            self.counters.jobs_submitted += 1
            self.futile += 1
            self._end(failed, None, State.FAILED, status.code_for(exc), str(exc))
            return
        self._start(job)

    def _reject(self, job_id: int, message: str, now_ns: int) -> None:
        """Answer a capsule that makes no job (undecodable, duplicate or reserved id)."""
        self._hooks.rejected()
        self.futile += 1
        reply = capsule.pack_completion(
            job_id, State.FAILED, status.INVALID_ARGUMENT, 0, 0, 0, now_ns, 0, now_ns, message
        )
        self._send(reply, None)

    # ------------------------------------------------------------ SubmitJob

    def submit_rpc(
        self,
        request: JobRequest,
        *,
        request_id: str,
        rpc_request_id: str,
        wait_for_slot: bool,
        answer: Callable[[JobRecord | BaseException], None],
    ) -> None:
        """Admit a SubmitJob request; `answer` gets the job (or the error), maybe later.

        Idempotent on `request_id`. Without a free slot the request waits for one when
        `wait_for_slot`, else fails with ResourceExhausted.
        """
        asked = _asked(request)
        try:
            if request_id and request_id in self.by_request:
                job_id, first = self.by_request[request_id]
                _same_request(request_id, first, asked)
                answer(self.job(job_id))
                return
            if request_id and request_id in self._waiting_by_request:
                waiter = self._waiting_by_request[request_id]
                _same_request(request_id, waiter.asked, asked)
                waiter.answers.append(answer)  # a retry
                return
            job = admit(
                self, request, Origin.GRPC, request_id=request_id, rpc_request_id=rpc_request_id
            )
        except AgentError as exc:
            answer(exc)
            return
        if len(self.open) < self.queue_depth:
            self._admit_rpc(job, answer, asked)
        elif not wait_for_slot:
            answer(
                ResourceExhausted(
                    f"all {self.queue_depth} queue slots are in use; retry, or set wait_for_slot"
                )
            )
        elif len(self._waiting) >= MAX_WAITING:
            answer(ResourceExhausted(f"{MAX_WAITING} SubmitJob requests already wait for a slot"))
        else:
            waiter = _Waiter(job, answer, asked)
            self._waiting.append(waiter)
            if request_id:
                self._waiting_by_request[request_id] = waiter
            self._arm_sweeper()

    def withdraw(self, answer: Callable[[JobRecord | BaseException], None]) -> None:
        """The caller behind `answer` went away: it waits for a slot no more.

        A request nobody waits for is dropped, never run; one admitted already runs on.
        """
        for waiter in self._waiting:
            if answer in waiter.answers:
                waiter.answers.remove(answer)
                if not waiter.answers:
                    self._waiting.remove(waiter)
                    self._forget_waiter(waiter)
                return

    def _forget_waiter(self, waiter: _Waiter) -> None:
        key = waiter.job.request_id
        if key and self._waiting_by_request.get(key) is waiter:
            del self._waiting_by_request[key]

    def _admit_rpc(
        self,
        job: JobRecord,
        answer: Callable[[JobRecord | BaseException], None],
        asked: JobRequest,
    ) -> None:
        try:
            self._hooks.check_accepting()
        except AgentError as exc:
            answer(exc)
            return
        if job.request_id:
            self.by_request[job.request_id] = (job.job_id, asked)
        self._start(job)
        answer(job)

    def job(self, job_id: int) -> JobRecord:
        """An open or retained job (KeyError if neither)."""
        found = self.open.get(job_id) or self.retained.get(job_id)
        if found is None:
            raise KeyError(job_id)
        return found

    # ------------------------------------------------------------ running

    def _start(self, job: JobRecord) -> None:
        self.open[job.job_id] = job
        self.counters.jobs_submitted += 1
        now = immediate(job)
        if now is not None:
            self._run_now(job, now)
            return
        write = queued_write(job) if self._storage is not None else None
        if write is not None:
            self._queue_write(job, write)
            return
        token = self._next_token
        self._next_token = token + 1
        run = _Run(job, token)
        self._runs[token] = run
        self._run_of[job.job_id] = run
        if self._sweeper is None:
            self._arm_sweeper()  # deadlines hold even while an operation is in flight
        if job.kind in STORAGE_KINDS:
            if not self.storage_free or self._storage_waiting:
                run.waits_for_storage = True  # QUEUED until a storage call returns
                self._storage_waiting.append(run)
                return
            self.storage_free -= 1
            run.storage_slot = True
        self._stage(run)

    def _stage(self, run: _Run) -> None:
        """Give the run its staging buffers (maybe once free), then launch it."""
        largest, count = buffers_needed(run.job)
        if count:
            size = self._staging.pool_for(largest)
            if pipelined(run.job, size) and self._staging.capacity(size) >= PIPELINED:
                count = PIPELINED
            run.staging_wait = self._staging.take(
                size, count, lambda buffers: self._launch(run, buffers)
            )
        else:
            self._launch(run, [])

    def _run_now(self, job: JobRecord, run: Callable[[JobRecord], None]) -> None:
        """Run and end a job that needs no operation (`runners.immediate`)."""
        job.start()
        try:
            run(job)
        except Exception as exc:  # noqa: BLE001 - every failure ends the job, one way
            self._end_raised(job, None, exc)
        else:
            self._end(job, None, State.SUCCEEDED, status.OK, "")

    def _queue_write(self, job: JobRecord, write: BatchWrite) -> None:
        """Queue a job that is one BatchWrite (`runners.queued_write`), after its QoS wait."""
        job.start()
        storage = self._storage
        assert storage is not None  # noqa: S101 - queued_write is asked only with a store
        try:
            reservation = storage.throttle(job.volume_id, "write", write.view.nbytes)
        except Exception as exc:  # noqa: BLE001 - as a runner's step: the job ends with it
            self._end_raised(job, None, exc)
            return
        if reservation.wait > 0:
            self._arm_sweeper()  # its deadline holds while it waits
            # kept so that ending the job cancels it (the timer holds the job's data) and
            # gives its tokens back
            timer = self._reactor.call_later(reservation.wait, lambda: self._queue_now(job, write))
            self._throttled[job.job_id] = (timer, reservation)
        else:
            self._queue_now(job, write)

    def _queue_now(self, job: JobRecord, write: BatchWrite) -> None:
        self._throttled.pop(job.job_id, None)
        if job.done:  # past its deadline while it waited (the end cancels the timer)
            return
        if time.monotonic() > job.deadline:  # as `_advance` checks before each step
            self._end_late(job, None)
            return
        job.bytes_read = write.view.nbytes  # the source is read: it came inline
        self._batch(job, None, write)

    def _batch(self, job: JobRecord, run: _Run | None, write: BatchWrite) -> None:
        """Add a BatchWrite to the pass's batch, for `_write_batch`."""
        if not self._writes:
            self._reactor.wake(self.link)  # so this pass ends with end_pass, which runs it
        self._writes.append((job, run, write))
        if run is not None:
            run.pending += 1

    def _end_late(self, job: JobRecord, run: _Run | None) -> None:
        """End a job whose deadline passed (each place that checks it calls this)."""
        self._end(job, run, State.FAILED, status.DEADLINE_EXCEEDED, LATE)

    def _end_raised(self, job: JobRecord, run: _Run | None, exc: Exception) -> None:
        """End a job whose step raised `exc`: its domain status, or INTERNAL for a bug."""
        if isinstance(exc, AgentError):
            self._end(job, run, State.FAILED, status.code_for(exc), str(exc))
            return
        log.error("job failed unexpectedly", exc_info=exc, extra={"job": job.job_id})
        self._end(job, run, State.FAILED, status.INTERNAL, "internal error")

    def _launch(self, run: _Run, buffers: list[Buffer]) -> None:
        job = run.job
        run.buffers = buffers
        run.staging_wait = None
        if job.done:  # ended while it waited for memory
            self._release(run)
            return
        job.start()
        run.gen = RUNNERS[job.kind](job, buffers, self._storage)
        self._advance(run, None, None)

    def _advance(self, run: _Run, value: object, error: BaseException | None) -> None:  # noqa: PLR0911 - one exit per way a step ends
        """Resume a job's runner until it waits on something, or ends."""
        job, gen = run.job, run.gen
        assert gen is not None  # noqa: S101 - launched
        while not job.done:
            if job.cancel_requested:
                self._end(job, run, State.CANCELLED, status.CANCELLED, "cancelled by request")
                return
            if time.monotonic() > job.deadline:
                self._end_late(job, run)
                return
            try:
                op = gen.throw(error) if error is not None else gen.send(value)
            except StopIteration:
                self._end(job, run, State.SUCCEEDED, status.OK, "")
                return
            except TransportError as exc:
                self.fail(exc)
                return
            except Exception as exc:  # noqa: BLE001 - a domain error or a bug, both end the job
                self._end_raised(job, run, exc)
                return
            try:
                waits, value, error = self._perform(run, op)
            except TransportError as exc:
                self.fail(exc)
                return
            if waits:
                return

    def _perform(self, run: _Run, op: Op) -> tuple[bool, object, BaseException | None]:  # noqa: PLR0911 - one exit per kind of operation
        """Start one operation: (whether the run now waits, value, error) to resume with."""
        kind = type(op)
        link = self.link
        if kind is Read:
            if run.job.inline:
                return False, None, _read_inline(run.job.inline, op)  # type: ignore[arg-type]
            b = op.buffer  # type: ignore[union-attr]
            link.post_read(b.region, b.offset + op.offset, op.length, op.addr, op.rkey, run.token)  # type: ignore[union-attr]
            run.pending += 1
            self._reactor.wake(link)
            return True, None, None
        if kind is Write:
            b = op.buffer  # type: ignore[union-attr]
            chained = op.last and run.job.origin is Origin.CAPSULE  # type: ignore[union-attr]
            token = None if chained else run.token
            link.post_write(b.region, b.offset + op.offset, op.length, op.addr, op.rkey, token)  # type: ignore[union-attr]
            self._reactor.wake(link)
            if chained:
                return False, None, None  # the COMPLETION's SEND follows and covers it
            run.pending += 1
            return True, None, None
        if kind is BatchWrite or kind is Io:
            return self._perform_store(run, op)  # type: ignore[arg-type]
        if kind is Work:
            run.pending += 1
            run.call = self._reactor.compute(op.fn, lambda f: self._resumed(run, f), key=self)  # type: ignore[union-attr]
            return True, None, None
        if kind is Sleep:
            run.timer = self._reactor.call_later(op.seconds, lambda: self._slept(run))  # type: ignore[union-attr]
            return True, None, None
        if kind is Together:
            return self._perform_together(run, op)  # type: ignore[arg-type]
        return False, None, TypeError(f"unknown job operation {op!r}")

    def _perform_together(
        self, run: _Run, op: Together
    ) -> tuple[bool, object, BaseException | None]:
        """Start every operation of `op`; the run waits until all have finished."""
        group = run.group = _Group(len(op.ops))
        for slot, sub in enumerate(op.ops):
            if isinstance(sub, Work):
                run.pending += 1
                run.call = self._reactor.compute(
                    sub.fn, functools.partial(self._resumed, run, slot=slot), key=self
                )
            elif (isinstance(sub, Read) and not run.job.inline) or (
                isinstance(sub, Write) and not sub.last
            ):
                self._perform(run, sub)  # posted with the run's token: on_done counts it
            else:
                group.done(None, None, TypeError(f"{sub!r} cannot run together with others"))
        if group.left:
            return True, None, None
        run.group = None
        return False, tuple(group.values), group.error

    def _step_done(
        self, run: _Run, value: object, error: BaseException | None, slot: int | None = None
    ) -> None:
        """An operation of the run finished: resume it (once its whole Together has)."""
        group = run.group
        if group is not None:
            if not group.done(slot, value, error):
                return
            run.group = None
            value, error = tuple(group.values), group.error
        self._advance(run, value, error)

    def _perform_store(
        self, run: _Run, op: Io | BatchWrite
    ) -> tuple[bool, object, BaseException | None]:
        """A storage call: gathered for the pass's batch, run inline, or on a storage worker."""
        if type(op) is BatchWrite:
            self._batch(run.job, run, op)
            return True, None, None
        if self._writes:
            self._write_batch()  # a session's store calls keep their order
        assert type(op) is Io  # noqa: S101 - the two kinds of storage operation
        if not op.blocking:
            try:
                return False, op.fn(), None
            except TransportError:
                raise
            except Exception as exc:  # noqa: BLE001 - thrown into the runner
                return False, None, exc
        run.pending += 1
        run.call = self._reactor.io(op.fn, lambda f: self._resumed(run, f), key=self)
        return True, None, None

    def _write_batch(self) -> None:
        """Run the gathered BatchWrites in one store call; resume each job with its result."""
        batch, self._writes = self._writes, []
        live = [i for i, (job, _, _) in enumerate(batch) if not job.done]
        storage = self._storage
        assert storage is not None  # noqa: S101 - a volume runner checked it before its BatchWrite
        errors: list[Exception | None] = [None] * len(batch)
        results: list[Exception | None] = []
        try:
            if live:
                results = list(storage.write_batch([batch[i][2] for i in live]))
        except Exception as exc:  # noqa: BLE001 - each job gets it (an AgentError, or INTERNAL)
            results = [exc] * len(live)
        for i, result in zip(live, results, strict=True):
            errors[i] = result
        for (job, run, _), error in zip(batch, errors, strict=True):
            if run is None:  # a job that was this one write
                if not job.done:
                    self._written(job, error)
                continue
            run.pending -= 1
            if job.done:  # ended meanwhile (cancelled; or the link failed, ending all)
                self._release_if_idle(run)
            else:
                self._advance(run, None, error)

    def _written(self, job: JobRecord, error: Exception | None) -> None:
        """End a job that was one BatchWrite, as its runner would have ended."""
        if error is not None:
            self._end_raised(job, None, error)
        elif time.monotonic() > job.deadline:
            self._end_late(job, None)
        else:
            self._end(job, None, State.SUCCEEDED, status.OK, "")

    def _resumed(
        self, run: _Run, future: concurrent.futures.Future[Any], slot: int | None = None
    ) -> None:
        run.pending -= 1
        run.call = None
        if run.job.done:
            self._release_if_idle(run)
            return
        if future.cancelled():  # only the reactor's stop drops a live job's call
            self._step_done(run, None, Unavailable("the agent is stopping"), slot)
            return
        exc = future.exception()
        if exc is None:
            self._step_done(run, future.result(), None, slot)
        else:
            self._step_done(run, None, exc, slot)

    def _slept(self, run: _Run) -> None:
        run.timer = None
        if not run.job.done:
            self._advance(run, None, None)

    def on_done(self, token: int, error: TransportError | None) -> None:
        """A link operation of run `token` finished."""
        run = self._runs.get(token)
        if run is None:
            return
        run.pending -= 1 if run.pending else 0
        if error is not None:
            self.fail(error)
            self._release_if_idle(run)
            return
        if run.job.done:
            self._release_if_idle(run)
            return
        self._step_done(run, None, None)

    # ------------------------------------------------------------ ending

    def _end(self, job: JobRecord, run: _Run | None, state: State, code: int, message: str) -> None:
        """Finish a job: free its slot, send its COMPLETION, queue it for publishing."""
        if job.job_id in self._core and not self._core_ended(job):
            return
        if not job.finish(state, code, message):
            return
        self.open.pop(job.job_id, None)
        self._retain(job)
        c = self.counters
        if state == State.SUCCEEDED:
            c.jobs_completed += 1
        else:
            c.jobs_failed += 1
        c.bytes_read += job.bytes_read
        c.bytes_written += job.bytes_written
        self._finished.append(job)
        if self._throttled:
            throttled = self._throttled.pop(job.job_id, None)
            if throttled is not None:  # a write waiting for its volume's QoS: it never runs
                timer, reservation = throttled
                timer.cancel()
                reservation.give_back()  # later jobs of the volume must not wait for it
        token = None if run is None else self._end_run(run)
        if job.origin is Origin.CAPSULE and not self.failed:
            self._send(job.encode_completion(), token)
        if self._waiting and len(self.open) < self.queue_depth:
            self._serve_waiting()

    def _core_ended(self, job: JobRecord) -> bool:
        """Whether a job the link started is ours to end now (else the link answered it).

        If the link had answered it, `core_cancel` has just reported that
        (`on_core_done`), and the job ended as the link says.
        """
        if not self.link.core_cancel(job.job_id) and job.done:
            return False
        self._core.discard(job.job_id)
        return True

    def _end_run(self, run: _Run) -> int | None:
        """Stop an ended job's run; the token of the SEND to release its buffers after.

        What it waits for and has not begun is dropped: a worker call, its turn for a
        storage slot.
        """
        job = run.job
        self._run_of.pop(job.job_id, None)
        if run.gen is not None:
            run.gen.close()
        if run.timer is not None:
            run.timer.cancel()
            run.timer = None
        if run.call is not None:
            run.call.cancel()  # a worker call not started is dropped (`done` still comes)
        if run.waits_for_storage:
            run.waits_for_storage = False
            self._storage_waiting.remove(run)
        if run.staging_wait is not None:  # its buffers never came: it stops waiting
            self._staging.forget(run.staging_wait)
            run.staging_wait = None
        if job.origin is Origin.CAPSULE and run.buffers and not self.failed:
            run.pending += 1
            return run.token  # the SEND covers the job's last WRITE: release after it
        self._release_if_idle(run)
        return None

    def _release_if_idle(self, run: _Run) -> None:
        if run.pending <= 0 and run.job.done:
            self._release(run)

    def _release(self, run: _Run) -> None:
        self._runs.pop(run.token, None)
        if run.buffers and not self.closed:
            buffers, run.buffers = run.buffers, []
            self._staging.give_back(buffers)
        if run.storage_slot:
            run.storage_slot = False
            self.storage_free += 1
            self._serve_storage_waiting()

    def _serve_storage_waiting(self) -> None:
        """Hand free storage slots to the runs waiting for one, in order.

        Not again from inside: a run started here that ends at once (its volume is gone)
        frees its slot, and this loop hands it on, where a nested call per run would
        exhaust the stack with a long queue.
        """
        if self._serving_storage:
            return
        self._serving_storage = True
        waiting = self._storage_waiting
        try:
            while waiting and self.storage_free:
                run = waiting.popleft()
                run.waits_for_storage = False
                self.storage_free -= 1
                run.storage_slot = True
                self._stage(run)
        finally:
            self._serving_storage = False

    def _retain(self, job: JobRecord) -> None:
        retained = self.retained
        # A job id used again: its record moves to the end (assigning would keep the
        # first job's place, and the latest job would be the next one forgotten).
        retained.pop(job.job_id, None)
        retained[job.job_id] = job
        while len(retained) > self._retained_max:
            old_id, old = retained.popitem(last=False)
            if old.request_id and self.by_request.get(old.request_id, (0,))[0] == old_id:
                del self.by_request[old.request_id]

    def _send(self, message: bytes, token: int | None) -> None:
        if self._backlog or self.link.room() == 0:
            if len(self._backlog) >= self._backlog_max:  # DP-2.6-6
                self.fail(
                    TransportError(
                        f"the host takes no COMPLETIONs: {len(self._backlog)} wait to be "
                        "sent, the most a session may hold"
                    )
                )
                return
            self._backlog.append((message, token))
            return
        try:
            self.link.post_send(message, token)
        except TransportError as exc:
            self.fail(exc)
            return
        self._reactor.wake(self.link)

    def _send_backlog(self) -> None:
        backlog = self._backlog
        while backlog and self.link.room() and not self.failed:
            message, token = backlog.popleft()
            try:
                self.link.post_send(message, token)
            except TransportError as exc:
                self.fail(exc)
                return
        self._reactor.wake(self.link)

    def _serve_waiting(self) -> None:
        while self._waiting and len(self.open) < self.queue_depth:
            waiter = self._waiting.popleft()
            self._forget_waiter(waiter)
            self._admit_rpc(waiter.job, waiter.answer, waiter.asked)

    # ------------------------------------------------------------ cancel, deadlines

    def cancel(self, job_id: int, message: str) -> None:
        """End an open job CANCELLED now (a job not open is ignored)."""
        job = self.open.get(job_id)
        if job is None:
            return
        job.cancel_requested = True
        self._end(job, self._run_of.get(job_id), State.CANCELLED, status.CANCELLED, message)

    def _arm_sweeper(self) -> None:
        if self._sweeper is None and not self.closed:
            self._sweeper = self._reactor.call_later(SWEEP_S, self._sweep)

    def _sweep(self) -> None:
        """End the jobs whose deadline passed while they waited on something."""
        self._sweeper = None
        now = time.monotonic()
        for job in [j for j in self.open.values() if now > j.deadline]:
            self._end_late(job, self._run_of.get(job.job_id))
        if any(now > waiter.job.deadline for waiter in self._waiting):
            waiting, self._waiting = self._waiting, collections.deque()
            for waiter in waiting:
                if now > waiter.job.deadline:
                    self._forget_waiter(waiter)
                    waiter.answer(
                        DeadlineExceeded("the job's deadline passed while it waited for a slot")
                    )
                else:
                    self._waiting.append(waiter)
        if self.open or self._waiting:
            self._arm_sweeper()
        self.end_pass()

    # ------------------------------------------------------------ failure and close

    def fail(self, error: TransportError) -> None:
        """The link failed: every open job FAILED (UNAVAILABLE), the session FAILED."""
        if self.failed or self.closed:
            return
        self.failed = True
        message = f"data plane failed: {error}"
        self._stop_starting()
        for job in list(self.open.values()):
            self._end(job, self._run_of.get(job.job_id), State.FAILED, status.UNAVAILABLE, message)
        self._backlog.clear()
        self._hooks.data_plane_failed(error)
        self._answer_waiting()

    def _stop_starting(self) -> None:
        """The session ends: no job that waits for staging buffers or a storage slot starts.

        Each open job is then ended as it is. Otherwise every job ended hands its buffers
        to the next one waiting, which is launched (its runner made, its first operation
        posted on a link that is gone) only to be ended in turn: a session with a long
        queue held the reactor, and every other session, for a second.
        """
        self._staging.drop_waiters()
        for run in self._storage_waiting:
            run.waits_for_storage = False
        self._storage_waiting.clear()

    def _answer_waiting(self) -> None:
        """The session takes no jobs any more: answer who waits for a slot (with why)."""
        waiting, self._waiting = self._waiting, collections.deque()
        self._waiting_by_request.clear()
        for waiter in waiting:
            self._admit_rpc(waiter.job, waiter.answer, waiter.asked)  # the check refuses it

    def close(self, state: State, code: int, reason: str, done: Callable[[], None]) -> None:
        """End every open job (`state`), send their COMPLETIONs, then tear the link down."""
        if self.closed:
            done()
            return
        self._stop_starting()
        for job in list(self.open.values()):
            self._end(job, self._run_of.get(job.job_id), state, code, reason)
        self._answer_waiting()
        self.end_pass()
        deadline = time.monotonic() + CLOSE_DRAIN_S

        def finish() -> None:
            if self.link.error is None and self.link.outstanding and time.monotonic() < deadline:
                self._reactor.read_now(self.link)  # within the tenant's allowance
                self.link.flush()
                self._reactor.call_later(0.001, finish)
                return
            self.closed = True
            if self._sweeper is not None:
                self._sweeper.cancel()
            self._reactor.remove(self.link)
            self.link.close()
            self._staging.close()
            self.end_pass()
            done()

        # Never inside a call from the link (a failure is often reported from its poll):
        # the link is closed on the reactor's next pass, with nothing of it on the stack.
        self._reactor.call(finish)


def _read_inline(inline: bytes, op: Read) -> BaseException | None:
    """A READ of an INLINE SUBMIT's source: copied from the capsule, no operation sent.

    The span's addr is an offset in the inline bytes (the SUBMIT's source.addr is 0).
    """
    n = op.length
    chunk = inline[op.addr : op.addr + n]
    if len(chunk) != n:  # admission keeps a runner's READs inside the source
        return InvalidArgument("a READ past the inline source")
    at = op.buffer.offset + op.offset
    op.buffer.region.view[at : at + n] = chunk
    return None


def _asked(request: JobRequest) -> JobRequest:
    """A SubmitJob request as its caller asked it: without the id the agent gives its job."""
    return request._replace(job_id=0)


def _same_request(request_id: str, first: JobRequest, again: JobRequest) -> None:
    """InvalidArgument unless a SubmitJob retry asks what the first call with its key did."""
    if first != again:
        raise InvalidArgument(
            f"request_id {request_id!r} was used for another SubmitJob request on this "
            "session: give each distinct request its own"
        )

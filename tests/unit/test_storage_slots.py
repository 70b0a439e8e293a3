"""A session's storage calls count against its queue depth until they return.

A job's queue slot frees when the job ends (CANCEL, deadline), but its storage call may
still be queued or running on a storage worker. Each volume job therefore takes one of
the session's `queue_depth` storage slots before it starts and gives it back only once
its call returned: a host that sends VOLUME_TRIM + CANCEL pairs keeps at most
`queue_depth` calls in the agent, and its next volume jobs wait QUEUED (data-plane.md
2.6). An ended job's call that has not started is dropped. The pipeline runs here with
a fake reactor whose storage workers the test drives; end to end:
tests/faults/test_volume_cancel_storm.py.
"""

from __future__ import annotations

import collections
import concurrent.futures
from typing import TYPE_CHECKING, Any, cast

from dpu_agent.dataplane import pipeline
from dpu_agent.dataplane.jobs import JobState
from dpu_agent.dataplane.regions import RegionTable
from dpu_agent.errors import NotFound
from dpu_agent.storage.qos import NO_WAIT
from dpu_wire import capsule
from dpu_wire.capsule import Span, State
from dpu_wire.jobkinds import FLAG_INLINE, JobKind
from dpu_wire.transport.base import TransportError
from tests.links import NoStaging, StandInHooks

if TYPE_CHECKING:
    from collections.abc import Callable

    from dpu_agent.dataplane.reactor import Reactor
    from dpu_agent.dataplane.runners import Storage
    from dpu_agent.dataplane.staging import Staging
    from dpu_agent.storage.qos import Reservation
    from dpu_wire.transport.base import AgentLink

QD = 4
GiB = 1 << 30


class _Link:
    """Records the COMPLETIONs a pipeline sends."""

    inline_max = 1 << 20

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def room(self) -> int:
        return 1 << 20

    def post_send(self, message: bytes, _token: int | None = None) -> None:
        self.sent.append(bytes(message))

    def flush(self) -> None:
        pass

    def fast_regions(self, _regions: list[tuple[int, int, int]], _sink: object) -> bool:
        return False  # no native core: every capsule goes through the pipeline

    def replies(self) -> list[tuple[int, int, int]]:
        """(job id, state, status) of each COMPLETION sent."""
        return [capsule.completion_fields(reply)[:3] for reply in self.sent]


class _Store:
    """A volume store whose calls the storage workers make (they never run here)."""

    def __init__(self) -> None:
        self.gone = False  # the volume was deleted: every job fails as it starts

    def throttle(self, _volume_id: str, _op: str, _nbytes: int) -> Reservation:
        if self.gone:
            raise NotFound("the volume is gone")
        return NO_WAIT

    def trim(self, _volume_id: str, _offset: int, _length: int) -> None:
        raise AssertionError("the fake workers run no call")


class _Reactor:
    """The reactor's side: storage calls wait in `calls` until the test starts or ends them.

    Like `Reactor.io`, a call's future may be cancelled while it has not started; its
    `done` then comes back through the reactor's inbox (`run_inbox`).
    """

    def __init__(self) -> None:
        self.calls: list[concurrent.futures.Future[Any]] = []
        self.inbox: collections.deque[Callable[[], None]] = collections.deque()
        self.timers: list[Callable[[], None]] = []

    def io(
        self,
        _fn: Callable[[], Any],
        done: Callable[[concurrent.futures.Future[Any]], None],
        *,
        key: object = None,  # noqa: ARG002 - the session's turn: one queue here
    ) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.add_done_callback(lambda f: self.inbox.append(lambda: done(f)))
        self.calls.append(future)
        return future

    compute = io  # a compute step: the same for these tests

    def wake(self, _link: object) -> None:
        pass

    def call_later(self, _seconds: float, fn: Callable[[], None]) -> Any:
        self.timers.append(fn)
        return _Timer()

    def start_all(self) -> None:
        """Storage workers take every call queued (slow calls: they do not return yet)."""
        for future in self.calls:
            if not future.done() and not future.running():
                future.set_running_or_notify_cancel()

    def finish(self, count: int) -> None:
        """The first `count` running calls return."""
        for future in [f for f in self.calls if f.running()][:count]:
            future.set_result(None)

    def run_inbox(self) -> None:
        while self.inbox:
            self.inbox.popleft()()

    @property
    def outstanding(self) -> int:
        """Storage calls queued or running: not returned, not dropped."""
        return sum(1 for f in self.calls if not f.done())


class _Timer:
    def cancel(self) -> None:
        pass


def _pipeline(
    link: _Link, reactor: _Reactor, *, store: _Store | None = None, queue_depth: int = QD
) -> pipeline.Pipeline:
    return pipeline.Pipeline(
        hooks=cast("pipeline.SessionHooks", StandInHooks({1: "v"})),
        link=cast("AgentLink", link),
        reactor=cast("Reactor", reactor),
        staging=cast("Staging", NoStaging()),  # trims take no staging buffer
        regions=RegionTable(),
        storage=cast("Storage", store or _Store()),
        queue_depth=queue_depth,
        default_deadline=30.0,
    )


def _trim(job_id: int, deadline_ms: int = 0) -> memoryview:
    """A VOLUME_TRIM of the whole (1 GiB) volume attached under handle 1."""
    return memoryview(
        capsule.pack_submit(
            job_id, JobKind.VOLUME_TRIM, Span(), handle=1, length=GiB, deadline_ms=deadline_ms
        )
    )


def _cancel(job_id: int) -> memoryview:
    return memoryview(capsule.Cancel(job_id).encode())


def _sweep(reactor: _Reactor) -> None:
    """Run the deadline sweeps due (each arms the next)."""
    timers, reactor.timers = reactor.timers, []
    for fn in timers:
        fn()


def test_submit_and_cancel_pairs_leave_at_most_queue_depth_storage_calls():
    """The storm of audit finding 1: each pair's job ends at once, its call (slow) not."""
    link, reactor = _Link(), _Reactor()
    pipe = _pipeline(link, reactor)
    for job_id in range(1, 101):
        pipe.on_capsule(_trim(job_id))
        reactor.start_all()  # the workers are free: each call starts, and takes long
        pipe.on_capsule(_cancel(job_id))
        reactor.run_inbox()
    assert reactor.outstanding == QD
    assert len(reactor.calls) == QD  # jobs 5..100 waited QUEUED and made no call
    assert link.replies() == [(j, State.CANCELLED, 1) for j in range(1, 101)]
    assert not pipe.open
    reactor.finish(QD)  # the calls return: the slots come back, nothing waits for them
    reactor.run_inbox()
    assert pipe.storage_free == QD
    pipe.on_capsule(_trim(101))
    assert len(reactor.calls) == QD + 1


def test_a_job_waits_queued_for_a_storage_slot_and_obeys_cancel_and_its_deadline():
    link, reactor = _Link(), _Reactor()
    pipe = _pipeline(link, reactor)
    for job_id in range(1, QD + 1):  # every slot's call runs on, its job cancelled
        pipe.on_capsule(_trim(job_id))
        reactor.start_all()
        pipe.on_capsule(_cancel(job_id))
    reactor.run_inbox()
    pipe.on_capsule(_trim(10))
    pipe.on_capsule(_trim(11, deadline_ms=1))
    pipe.on_capsule(_trim(12))
    waiting = [pipe.open[j] for j in (10, 11, 12)]
    assert [(job.state, job.start_ns) for job in waiting] == [(JobState.QUEUED, 0)] * 3
    assert len(reactor.calls) == QD  # no call made for them
    pipe.on_capsule(_cancel(10))
    pipe.open[11].deadline = 0.0  # passed while it waited
    _sweep(reactor)
    assert link.replies()[-2:] == [(10, State.CANCELLED, 1), (11, State.FAILED, 4)]
    reactor.finish(1)  # one call returned: job 12 gets its slot, and its call
    reactor.run_inbox()
    assert pipe.open[12].state == JobState.RUNNING
    assert len(reactor.calls) == QD + 1
    assert reactor.outstanding == QD


def test_a_long_queue_of_jobs_that_fail_as_they_start_is_served_in_one_loop():
    """1024 jobs wait for a slot; their volume is gone, so each fails as it gets one and
    hands its slot on at once: one loop serves them all, no recursion per job."""
    depth = 1024
    link, reactor, store = _Link(), _Reactor(), _Store()
    pipe = _pipeline(link, reactor, store=store, queue_depth=depth)
    for job_id in range(1, depth + 1):
        pipe.on_capsule(_trim(job_id))
        reactor.start_all()
        pipe.on_capsule(_cancel(job_id))
    for job_id in range(depth + 1, 2 * depth + 1):
        pipe.on_capsule(_trim(job_id))
    store.gone = True
    reactor.finish(1)
    reactor.run_inbox()
    assert not pipe.open
    assert link.replies()[-depth:] == [
        (j, State.FAILED, 5) for j in range(depth + 1, 2 * depth + 1)
    ]
    assert pipe.storage_free == 1  # the other calls still run


def test_an_ended_jobs_storage_call_that_has_not_started_is_dropped():
    """Its job is CANCELLED or past its deadline: the call never runs, its slot comes back."""
    link, reactor = _Link(), _Reactor()
    pipe = _pipeline(link, reactor)
    pipe.on_capsule(_trim(1))
    pipe.on_capsule(_trim(2, deadline_ms=1))
    first, second = reactor.calls
    pipe.on_capsule(_cancel(1))
    pipe.open[2].deadline = 0.0
    _sweep(reactor)
    assert first.cancelled()
    assert second.cancelled()
    reactor.run_inbox()
    assert pipe.storage_free == QD
    assert link.replies() == [(1, State.CANCELLED, 1), (2, State.FAILED, 4)]


def test_a_failed_session_drops_its_calls_not_started_and_its_waiting_jobs():
    link, reactor = _Link(), _Reactor()
    pipe = _pipeline(link, reactor)
    for job_id in range(1, QD + 1):
        pipe.on_capsule(_trim(job_id))
    for future in reactor.calls[:2]:
        future.set_running_or_notify_cancel()  # two calls run, two wait for a worker
    pipe.on_capsule(_cancel(1))
    pipe.on_capsule(_cancel(2))
    pipe.on_capsule(_trim(5))
    pipe.on_capsule(_trim(6))
    assert len(reactor.calls) == QD  # jobs 5 and 6 wait for the slots of 1 and 2
    pipe.fail(TransportError("the link broke"))
    assert not pipe.open
    assert [f.cancelled() for f in reactor.calls] == [False, False, True, True]
    reactor.run_inbox()
    reactor.finish(2)
    reactor.run_inbox()
    assert len(reactor.calls) == QD  # the jobs that waited for a slot made no call
    assert pipe.storage_free == QD
    assert link.replies() == [(1, State.CANCELLED, 1), (2, State.CANCELLED, 1)]
    ended = [pipe.retained[j] for j in range(3, 7)]  # no COMPLETION: the link failed
    assert [(job.state, job.status) for job in ended] == [(JobState.FAILED, 14)] * 4


def test_an_ended_jobs_compute_step_that_has_not_started_is_dropped():
    """The same for a compute worker: a CRC-32C of a 128 KiB inline source is one Work."""
    link, reactor = _Link(), _Reactor()
    pipe = _pipeline(link, reactor)
    data = bytes(128 << 10)
    submit = capsule.pack_submit(1, JobKind.CRC32C, Span(0, len(data), 0), flags=FLAG_INLINE)
    pipe.on_capsule(memoryview(submit + data))
    (work,) = reactor.calls
    pipe.on_capsule(_cancel(1))
    assert work.cancelled()
    reactor.run_inbox()
    assert link.replies() == [(1, State.CANCELLED, 1)]
    assert pipe.storage_free == QD  # a CRC takes no storage slot

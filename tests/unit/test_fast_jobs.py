"""The pipeline's side of a link's fast path (`AgentLink.fast_regions`, `FastSink`).

A verbs link with the native core runs COPY jobs itself while the pipeline says it may
(`fast_room`), between the regions the pipeline pushed: inline ones it runs and reports
at once (`on_fast_jobs`), ones whose source it READs it reports when it starts them
(`on_core_jobs`, the pipeline holds them open) and when it answered them
(`on_core_done`); the pipeline makes them the records it would have made, and ends the
open ones itself on CANCEL, deadline or failure (`AgentLink.core_cancel`). The core
itself runs on rxe in tests/vm/test_native_verbs.py.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, cast

from dpu_agent import status
from dpu_agent.dataplane import pipeline
from dpu_agent.dataplane.jobs import JobRecord, JobState, Origin
from dpu_agent.dataplane.regions import AdvertisedRegion, RegionTable
from dpu_wire import capsule
from dpu_wire.capsule import Span
from dpu_wire.jobkinds import FLAG_INLINE, JobKind
from dpu_wire.transport.base import Access, TransportError
from tests.links import NoStaging, StandInHooks, StandInReactor

if TYPE_CHECKING:
    from dpu_agent.dataplane.reactor import Reactor
    from dpu_agent.dataplane.staging import Staging
    from dpu_wire.transport.base import AgentLink, CoreJob, FastJob, FastRegion, FastSink


class _Link:
    """A link with a fast path: records the region lists it was given."""

    inline_max = 4096

    def __init__(self) -> None:
        self.pushed: list[list[FastRegion]] = []
        self.sent: list[bytes] = []
        self.free = 8
        self.sink: FastSink | None = None
        self.cancelled: list[int] = []
        self.answered: dict[int, tuple[int, int, int]] = {}  # the core answered, unreported

    def fast_regions(self, regions: list[FastRegion], sink: FastSink) -> bool:
        self.pushed.append(regions)
        self.sink = sink
        return True

    def core_cancel(self, job_id: int) -> bool:
        self.cancelled.append(job_id)
        done = self.answered.pop(job_id, None)
        if done is None:
            return True
        assert self.sink is not None
        self.sink.on_core_done([done])
        return False

    def room(self) -> int:
        return self.free

    def post_send(self, message: bytes, _token: int | None = None) -> None:
        self.sent.append(bytes(message))

    def flush(self) -> None:
        pass


def _pipeline() -> tuple[pipeline.Pipeline, _Link, StandInHooks, RegionTable]:
    link, hooks, regions = _Link(), StandInHooks(), RegionTable()
    pipe = pipeline.Pipeline(
        hooks=cast("pipeline.SessionHooks", hooks),
        link=cast("AgentLink", link),
        reactor=cast("Reactor", StandInReactor()),
        staging=cast("Staging", NoStaging()),
        regions=regions,
        storage=None,
        queue_depth=4,
        default_deadline=30.0,
    )
    return pipe, link, hooks, regions


def _region(region_id: str, rkey: int, access: Access) -> AdvertisedRegion:
    return AdvertisedRegion(region_id, 0x10000 * rkey, 8192, rkey, access)


def _fast(job_id: int, length: int = 4096) -> FastJob:
    now = time.time_ns()
    return (job_id, length, 0x20000, 2, 0, now, now + 1, now + 2, 100 + 2 * job_id)


def _core(job_id: int, length: int = 65536, deadline_ms: int = 0) -> CoreJob:
    now = time.time_ns()
    return (job_id, length, 0x10000, 1, 0x20000, 2, deadline_ms, now, now + 1)


def test_the_link_gets_the_regions_again_after_each_change():
    pipe, link, _, regions = _pipeline()
    assert link.pushed == [[]]  # the fast path is set up with none
    assert pipe.fast_room() == 4
    assert link.pushed == [[], []]
    regions.add(_region("in", 1, Access.REMOTE_READ))
    regions.add(_region("out", 2, Access.REMOTE_WRITE))
    assert pipe.fast_room() == 4
    assert pipe.fast_room() == 4  # no change, no push
    assert link.pushed[2:] == [[(0x10000, 8192, 1, 1), (0x20000, 8192, 2, 2)]]
    regions.remove("out")  # withdrawn: the link forgets it at once, before any poll
    assert link.pushed[3:] == [[(0x10000, 8192, 1, 1)]]
    assert pipe.fast_room() == 4
    assert len(link.pushed) == 4  # nothing new since
    regions.add(_region("out2", 3, Access.REMOTE_WRITE))
    regions.clear()  # the session closes, say
    assert link.pushed[-1] == []


def test_no_fast_job_while_a_job_is_open_a_completion_waits_or_the_agent_drains():
    pipe, link, hooks, _ = _pipeline()
    assert pipe.fast_room() == 4
    pipe.open[5] = cast("JobRecord", object())  # a job the pipeline runs
    assert pipe.fast_room() == 0
    del pipe.open[5]
    assert pipe.fast_room() == 4
    hooks.draining = True
    assert pipe.fast_room() == 0
    hooks.draining = False
    link.free = 0  # a refusal finds the send queue full: it waits in the backlog
    pipe.on_capsule(memoryview(b"\x00" * 16))
    assert not link.sent
    assert pipe.fast_room() == 0  # the core's COMPLETIONs would overtake it
    link.free = 8
    pipe.end_pass()
    assert len(link.sent) == 1
    assert pipe.fast_room() == 4


def test_fast_jobs_become_the_records_the_pipeline_would_make():
    pipe, _, hooks, _ = _pipeline()
    jobs = [_fast(1), _fast(2, 10)]
    pipe.on_fast_jobs(jobs, False)
    assert not pipe.open
    assert list(pipe.retained) == [1, 2]
    first = pipe.retained[1]
    assert (first.kind, first.origin, first.state, first.status) == (
        JobKind.COPY,
        Origin.CAPSULE,
        JobState.SUCCEEDED,
        status.OK,
    )
    assert first.source == Span(0, 4096, 0)
    assert first.destination == Span(0x20000, 4096, 2)
    assert (first.bytes_read, first.bytes_written) == (4096, 4096)
    assert first.submit_ns < first.start_ns < first.end_ns
    assert first.done
    c = pipe.counters
    assert (c.jobs_submitted, c.jobs_completed, c.jobs_native, c.jobs_failed) == (2, 2, 2, 0)
    assert (c.bytes_read, c.bytes_written) == (4106, 4106)
    pipe.end_pass()  # published with the pass, as every finished job is
    assert [job.job_id for job in hooks.published] == [1, 2]


def test_a_fast_job_whose_completion_was_never_posted_failed():
    pipe, _, _, _ = _pipeline()
    pipe.on_fast_jobs([_fast(1), _fast(2)], True)
    assert pipe.retained[1].state == JobState.SUCCEEDED
    last = pipe.retained[2]
    assert (last.state, last.status) == (JobState.FAILED, status.UNAVAILABLE)
    c = pipe.counters
    assert (c.jobs_completed, c.jobs_native, c.jobs_failed) == (1, 1, 1)


def test_a_job_id_used_by_a_fast_job_is_free_again():
    # a fast job is never open: the host may use its id again at once (DP-2.5-6)
    pipe, link, _, regions = _pipeline()
    regions.add(_region("in", 1, Access.REMOTE_READ))
    pipe.on_fast_jobs([_fast(9)], False)
    source = b"x" * 16
    submit = capsule.pack_submit(9, JobKind.CRC32C, Span(0, 16, 0), flags=FLAG_INLINE)
    pipe.on_capsule(memoryview(submit + source))
    (reply,) = link.sent
    assert capsule.completion_fields(reply)[1] == capsule.State.SUCCEEDED


def test_jobs_the_link_started_are_open_and_leave_it_room_for_the_rest():
    pipe, _, _, _ = _pipeline()
    pipe.on_core_jobs([_core(1), _core(2, 100, deadline_ms=5)])
    first, second = pipe.open[1], pipe.open[2]
    assert (first.kind, first.state, first.origin) == (
        JobKind.COPY,
        JobState.RUNNING,
        Origin.CAPSULE,
    )
    assert first.source == Span(0x10000, 65536, 1)
    assert first.destination == Span(0x20000, 65536, 2)
    assert first.submit_ns < first.start_ns
    assert second.deadline - first.deadline < -20  # 5 ms against the default 30 s
    assert pipe.job(1) is first  # GetJob finds it
    assert pipe.fast_room() == 2  # the queue slots they hold are taken
    pipe.open[7] = cast("JobRecord", object())  # a job the pipeline runs besides
    assert pipe.fast_room() == 0
    del pipe.open[7]
    assert pipe.counters.jobs_submitted == 2


def test_jobs_the_link_answered_end_as_it_says():
    pipe, link, hooks, _ = _pipeline()
    pipe.on_core_jobs([_core(1), _core(2, 100)])
    end = time.time_ns()
    pipe.on_core_done([(2, end, 1), (1, end + 5, 0)])
    assert not pipe.open
    assert pipe.fast_room() == 4
    ok, late = pipe.retained[1], pipe.retained[2]
    assert (ok.state, ok.status, ok.end_ns) == (JobState.SUCCEEDED, status.OK, end + 5)
    assert (ok.bytes_read, ok.bytes_written) == (65536, 65536)
    assert (late.state, late.status, late.message) == (
        JobState.FAILED,
        status.DEADLINE_EXCEEDED,
        "job deadline exceeded",
    )
    assert (late.bytes_read, late.bytes_written, late.end_ns) == (100, 0, end)
    c = pipe.counters
    assert (c.jobs_completed, c.jobs_native, c.jobs_failed) == (1, 1, 1)
    assert (c.bytes_read, c.bytes_written) == (65636, 65536)
    assert not link.sent  # the link sent their COMPLETIONs
    pipe.end_pass()
    assert [job.job_id for job in hooks.published] == [2, 1]


def test_a_cancel_ends_a_job_the_link_started_and_the_link_writes_nothing_for_it():
    pipe, link, _, _ = _pipeline()
    pipe.on_core_jobs([_core(3)])
    pipe.on_capsule(memoryview(capsule.Cancel(3).encode()))
    assert link.cancelled == [3]
    (reply,) = link.sent
    fields = capsule.completion_fields(reply)
    assert (fields[0], fields[1], fields[2]) == (3, capsule.State.CANCELLED, status.CANCELLED)
    assert pipe.retained[3].state == JobState.CANCELLED
    assert not pipe.open
    assert pipe.fast_room() == 4
    pipe.on_capsule(memoryview(capsule.Cancel(3).encode()))  # no longer open: ignored
    assert (len(link.sent), link.cancelled) == (1, [3])


def test_a_cancel_too_late_finds_the_job_answered_by_the_link():
    pipe, link, _, _ = _pipeline()
    pipe.on_core_jobs([_core(4)])
    link.answered[4] = (4, time.time_ns(), 0)  # its COMPLETION is posted, not yet reported
    pipe.on_capsule(memoryview(capsule.Cancel(4).encode()))
    assert link.cancelled == [4]
    assert not link.sent  # no second answer
    assert pipe.retained[4].state == JobState.SUCCEEDED
    assert pipe.counters.jobs_native == 1


def test_a_submit_with_the_id_of_a_job_the_link_started_is_refused():
    pipe, link, _, regions = _pipeline()
    regions.add(_region("in", 1, Access.REMOTE_READ))
    pipe.on_core_jobs([_core(9)])
    source = b"x" * 16
    submit = capsule.pack_submit(9, JobKind.CRC32C, Span(0, 16, 0), flags=FLAG_INLINE)
    pipe.on_capsule(memoryview(submit + source))
    (reply,) = link.sent
    fields = capsule.completion_fields(reply)
    assert (fields[0], fields[1], fields[2]) == (9, capsule.State.FAILED, status.INVALID_ARGUMENT)
    assert pipe.open[9].state == JobState.RUNNING  # the open job was not touched
    assert not link.cancelled


def test_jobs_the_link_started_fail_with_the_link_and_pass_their_deadline():
    pipe, link, _, _ = _pipeline()
    pipe.on_core_jobs([_core(1), _core(2)])
    pipe.open[2].deadline = time.monotonic() - 1
    pipe._sweep()
    assert pipe.retained[2].status == status.DEADLINE_EXCEEDED
    assert link.cancelled == [2]
    pipe.fail(TransportError("gone"))
    assert (pipe.retained[1].state, pipe.retained[1].status) == (
        JobState.FAILED,
        status.UNAVAILABLE,
    )
    assert link.cancelled == [2, 1]
    assert not pipe.open


def test_an_answer_to_a_job_the_link_did_not_start_fails_the_session_not_the_agent():
    # The link and the pipeline disagree (a bug, or a peer that found one): the session
    # ends, with its open jobs; raising here would end the reactor and every session.
    pipe, _, _, _ = _pipeline()
    pipe.on_core_jobs([_core(1)])
    pipe.on_core_done([(99, time.time_ns(), 0)])
    assert pipe.failed
    job = pipe.retained[1]
    assert (job.state, job.status) == (JobState.FAILED, status.UNAVAILABLE)
    assert "answered unknown jobs [99]" in job.message
    assert not pipe.open

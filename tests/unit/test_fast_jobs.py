"""The pipeline's side of a link's fast path (`AgentLink.fast_regions`, `FastSink`).

A verbs link with the native core runs inline COPY jobs itself while the pipeline says
it may (`fast_allowed`), into the regions the pipeline pushed, and reports them
(`on_fast_jobs`); the pipeline makes them the records it would have made. The core
itself runs on rxe in tests/vm/test_native_verbs.py.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, cast

from dpu_agent import status
from dpu_agent.dataplane import pipeline
from dpu_agent.dataplane.jobs import JobRecord, JobState, Origin
from dpu_agent.dataplane.regions import AdvertisedRegion, RegionTable
from dpu_agent.errors import Unavailable
from dpu_wire import capsule
from dpu_wire.capsule import Span
from dpu_wire.jobkinds import FLAG_INLINE, JobKind
from dpu_wire.transport.base import Access

if TYPE_CHECKING:
    from dpu_agent.dataplane.reactor import Reactor
    from dpu_agent.dataplane.staging import Staging
    from dpu_wire.transport.base import AgentLink, FastJob, FastSink


class _Link:
    """A link with a fast path: records the region lists it was given."""

    inline_max = 4096

    def __init__(self) -> None:
        self.pushed: list[list[tuple[int, int, int]]] = []
        self.sent: list[bytes] = []
        self.free = 8

    def fast_regions(self, regions: list[tuple[int, int, int]], _sink: FastSink) -> bool:
        self.pushed.append(regions)
        return True

    def room(self) -> int:
        return self.free

    def post_send(self, message: bytes, _token: int | None = None) -> None:
        self.sent.append(bytes(message))

    def flush(self) -> None:
        pass


class _Hooks:
    def __init__(self) -> None:
        self.published: list[object] = []
        self.draining = False

    def check_accepting(self) -> None:
        if self.draining:
            raise Unavailable("the agent is shutting down and takes no new jobs")

    def ready(self) -> bool:
        return not self.draining

    def finished(self, jobs: list[object]) -> None:
        self.published.extend(jobs)

    def rejected(self) -> None:
        pass


class _Reactor:
    def wake(self, _link: object) -> None:
        pass

    def call_later(self, _seconds: float, _fn: object) -> object:
        return type("T", (), {"cancel": lambda _self: None})()


def _pipeline() -> tuple[pipeline.Pipeline, _Link, _Hooks, RegionTable]:
    link, hooks, regions = _Link(), _Hooks(), RegionTable()
    pipe = pipeline.Pipeline(
        hooks=cast("pipeline.SessionHooks", hooks),
        link=cast("AgentLink", link),
        reactor=cast("Reactor", _Reactor()),
        staging=cast("Staging", None),
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


def test_the_link_gets_the_writable_regions_again_after_each_change():
    pipe, link, _, regions = _pipeline()
    assert link.pushed == [[]]  # the fast path is set up with none
    assert pipe.fast_allowed()
    assert link.pushed == [[], []]
    regions.add(_region("in", 1, Access.REMOTE_READ))
    regions.add(_region("out", 2, Access.REMOTE_WRITE))
    assert pipe.fast_allowed()
    assert pipe.fast_allowed()  # no change, no push
    assert link.pushed[2:] == [[(0x20000, 8192, 2)]]
    regions.remove("out")  # withdrawn: the link forgets it at once, before any poll
    assert link.pushed[3:] == [[]]
    assert pipe.fast_allowed()
    assert len(link.pushed) == 4  # nothing new since
    regions.add(_region("out2", 3, Access.REMOTE_WRITE))
    regions.clear()  # the session closes, say
    assert link.pushed[-1] == []


def test_no_fast_job_while_a_job_is_open_a_completion_waits_or_the_agent_drains():
    pipe, link, hooks, _ = _pipeline()
    assert pipe.fast_allowed()
    pipe.open[5] = cast("JobRecord", object())  # a job the pipeline runs
    assert not pipe.fast_allowed()
    del pipe.open[5]
    assert pipe.fast_allowed()
    hooks.draining = True
    assert not pipe.fast_allowed()
    hooks.draining = False
    link.free = 0  # a refusal finds the send queue full: it waits in the backlog
    pipe.on_capsule(memoryview(b"\x00" * 16))
    assert not link.sent
    assert not pipe.fast_allowed()  # the core's COMPLETIONs would overtake it
    link.free = 8
    pipe.end_pass()
    assert len(link.sent) == 1
    assert pipe.fast_allowed()


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
    assert [job.job_id for job in hooks.published] == [1, 2]  # type: ignore[attr-defined]


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

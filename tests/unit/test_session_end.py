"""A session that fails ends its jobs without starting the ones that wait (close too).

Jobs beyond the staging buffers wait for one (data-plane.md 2.6). When the session ends,
each open job is ended as it is: an ended job's buffers must not be handed to the next
one waiting, which would be launched (its runner made, its READ posted on a link that is
gone) only to be ended in turn. A hostile host that kept 16 sessions' queues full made
each such end hold the reactor, and every other session, for up to a second.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dpu_agent.dataplane.jobs import JobState
from dpu_wire import capsule
from dpu_wire.capsule import Span
from dpu_wire.jobkinds import JobKind
from dpu_wire.transport.base import TransportError
from tests.links import RecordingLink, stand_in_pipeline

if TYPE_CHECKING:
    from dpu_agent.dataplane import pipeline

CHUNK = 1 << 20
JOBS = 6


def _session() -> tuple[pipeline.Pipeline, RecordingLink]:
    pipe, link = stand_in_pipeline(JOBS, CHUNK, large=1)
    for job_id in range(1, JOBS + 1):  # 1 MiB copies: one large buffer, so one runs
        submit = capsule.pack_submit(
            job_id, JobKind.COPY, Span(0x100000, CHUNK, 1), Span(0x200000, CHUNK, 2)
        )
        pipe.on_capsule(memoryview(submit))
    assert len(link.reads) == 1  # job 1's READ; jobs 2..6 wait for its buffer
    return pipe, link


def test_a_failed_session_starts_none_of_the_jobs_waiting_for_buffers():
    pipe, link = _session()
    # The link fails: it reports job 1's READ with the error, which fails the session;
    # job 1, idle then, hands its buffer back while the other jobs are still open.
    pipe.on_done(link.reads[0], TransportError("the host went away"))
    assert pipe.failed
    assert len(link.reads) == 1, "a waiting job was launched on the failed link"
    assert not pipe.open
    ended = [pipe.retained[job_id] for job_id in range(1, JOBS + 1)]
    assert {(job.state, job.start_ns == 0) for job in ended[1:]} == {(JobState.FAILED, True)}

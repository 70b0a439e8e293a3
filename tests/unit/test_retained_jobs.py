"""A session retains its last finished jobs, a job id the host used again included.

data-plane.md 1.4: the retained jobs are the session's last 1024 finished, and a capsule
job id used again names the latest job with it. A reused id's record must therefore
count as finished when its latest job finished, not when the id's first job did:
otherwise it goes first when the retention is full, while older jobs stay.
"""

from __future__ import annotations

from dpu_wire import capsule
from dpu_wire.capsule import Span
from dpu_wire.jobkinds import JobKind
from tests.links import stand_in_pipeline

KEPT = 4


def test_a_reused_job_id_is_retained_as_recently_as_its_latest_job():
    pipe, _ = stand_in_pipeline(KEPT)
    pipe._retained_max = KEPT  # a small retention to fill

    def run(job_id: int) -> None:  # an INLINE CRC32C: it ends in the pass
        submit = capsule.pack_submit(job_id, JobKind.CRC32C, Span(0, 1, 0), flags=2) + b"x"
        pipe.on_capsule(memoryview(submit))
        pipe.end_pass()
        assert job_id not in pipe.open

    for job_id in (1, 2, 3, 4, 1, 5):  # the last four to finish: 3, 4, 1 (again), 5
        run(job_id)
    assert list(pipe.retained) == [3, 4, 1, 5]

"""Which capsules a session counts as futile: those that run no job (`Pipeline.futile`).

The reactor charges them to the session's tenant (test_reactor_allowance.py): refused
capsules (data-plane.md 2.5 rules 2, 3 and 5), SUBMITs whose job fails at admission
(rule 6), CANCELs of jobs that are not open. An admitted job and a CANCEL that ends one
cost nothing: a host that keeps to the protocol is never paused.
"""

from __future__ import annotations

from dpu_wire import capsule
from dpu_wire.capsule import AGENT_JOB_ID_BASE, Cancel, Span
from dpu_wire.jobkinds import JobKind
from tests.links import DESTINATION, SOURCE, stand_in_pipeline

SRC = Span(SOURCE.addr, 4096, SOURCE.rkey)
DST = Span(DESTINATION.addr, 4096, DESTINATION.rkey)


def _copy(job_id: int, src: Span = SRC, dst: Span = DST) -> bytes:
    return capsule.pack_submit(job_id, JobKind.COPY, src, dst)


def test_capsules_that_run_no_job_are_counted_and_the_others_are_not():
    pipe, link = stand_in_pipeline(queue_depth=2)
    useful = [_copy(1), Cancel(1).encode(), _copy(2)]
    for data in useful:
        pipe.on_capsule(memoryview(data))
    assert pipe.futile == 0
    assert 2 in pipe.open  # job 1 was cancelled (its COMPLETION sent), job 2 runs
    futile = {
        "undecodable (rule 2)": b"XX" + _copy(3)[2:],
        "a COMPLETION (rule 3)": capsule.pack_completion(
            4, capsule.State.SUCCEEDED, 0, 0, 0, 0, 0, 0, 0, ""
        ),
        "an open job's id (rule 5)": _copy(2),
        "an agent's job id (rule 5)": _copy(AGENT_JOB_ID_BASE),
        "a span outside its region (rule 6)": _copy(5, Span(SOURCE.addr, 8 << 20, SOURCE.rkey)),
        "beyond the credits (rule 6)": _copy(6),
        "a CANCEL of no open job": Cancel(99).encode(),
    }
    pipe.on_capsule(memoryview(_copy(7)))  # fills the second slot: 2 and 7 open
    sent = len(link.sent)
    for count, (name, data) in enumerate(futile.items(), start=1):
        pipe.on_capsule(memoryview(data))
        assert pipe.futile == count, name
    assert len(link.sent) == sent + len(futile) - 1  # each answered, the CANCEL aside

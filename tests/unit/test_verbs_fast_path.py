"""The verbs link's side of the native core's fast path, with a stand-in core.

`_QueuePair._poll_recv_native`: every capsule of a pass is handled, by the core or by
the pipeline, before the next send completion is taken, so a CANCEL right behind a job
whose READ the core has out finds that job open (DP-2.5-1, DP-2.3-2). The core itself
runs on rxe in tests/vm/test_native_verbs.py.
"""

from __future__ import annotations

import collections
import types
from typing import Any

from dpu_wire.transport import verbs
from dpu_wire.transport.base import TransportError


class _Core:
    """A stand-in `_vcore.Qp`: answers `serve` from a script and logs every call."""

    core_answered = 0
    core_wrs = 0
    core_busy = 0

    def __init__(self, served: list[tuple[Any, ...]]) -> None:
        self.served = served
        self.calls: list[str] = []

    def serve(self, budget: int, next_id: int, room: int, job_room: int) -> tuple[Any, ...]:
        self.calls.append(f"serve {budget} {room} {job_room}")
        return self.served.pop(0) if self.served else (next_id, [], [], None, 0, 0)

    def poll_send(self) -> None:
        self.calls.append("poll_send")

    def poll_recv(self) -> None:
        self.calls.append("poll_recv")


class _Sink:
    def __init__(self, room: int) -> None:
        self.room = room
        self.started: list[object] = []

    def fast_room(self) -> int:
        return self.room

    def on_core_jobs(self, jobs: list[object]) -> None:
        self.started.extend(jobs)


def _link(
    core: _Core, sink: _Sink, error: TransportError | None = None
) -> tuple[Any, list[tuple[int, int, int]]]:
    qp: Any = object.__new__(verbs._QueuePair)
    handed: list[tuple[int, int, int]] = []

    def received(_sink: object, slot: int, status: int, length: int) -> bool:
        handed.append((slot, status, length))
        core.calls.append("pipeline")
        return True

    qp.__dict__.update(
        _native=core,
        _fast=sink,
        error=error,
        _held=None,
        _unreported=[],
        _closed=False,
        _sq=collections.deque(),
        _next_wr_id=1,
        _config=types.SimpleNamespace(send_depth=64),
        _received=received,
    )
    return qp, handed


def _started(job_id: int) -> tuple[int, ...]:
    return (job_id, 65536, 0x1000, 1, 0x2000, 2, 0, 1, 2)


def test_a_capsule_the_core_hands_over_is_followed_by_the_rest_of_the_pass():
    # The core starts two READ jobs, then stops at a CANCEL: the pipeline takes it, and
    # the core goes on with the capsules behind it in the same pass, no send poll between.
    core = _Core([(1, [], [_started(1), _started(2)], (5, 0, 16), 0, 0), (1, [], [], None, 0, 0)])
    sink = _Sink(room=8)
    qp, handed = _link(core, sink)
    taken = qp._poll_recv_native(object(), 16)
    assert handed == [(5, 0, 16)]
    assert core.calls == ["serve 16 64 8", "pipeline", "serve 13 64 8"]
    assert taken == 3
    assert len(sink.started) == 2


def test_without_room_for_the_core_the_pipeline_takes_the_capsules():
    core = _Core([])
    qp, handed = _link(core, _Sink(room=0))
    assert qp._poll_recv_native(object(), 16) == 0
    assert core.calls == ["poll_recv"]
    assert not handed


def test_a_failed_link_starts_no_jobs_in_the_core():
    # The link failed (a READ of the core's was refused) before the pipeline heard of
    # it: capsules that had arrived must not start jobs on the dead queue pair, whose
    # send queue's room is no longer known (the failure dropped its records).
    core = _Core([])
    qp, _ = _link(core, _Sink(room=8), TransportError("the host refused a READ"))
    qp._poll_recv_native(object(), 16)
    assert core.calls == ["poll_recv"]

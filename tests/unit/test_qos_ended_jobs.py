"""QoS tokens of volume jobs that end before their I/O: no debt left for later jobs.

A job a volume's QoS limits delay reserves its tokens when it starts waiting (the
bucket goes into debt, `storage.qos`). If it is cancelled, passes its deadline or its
session ends while it waits, its I/O never happens; the tokens it had yet to wait for
go back, so the next job of the volume (here: another session of the same tenant)
waits only for I/O that is done. The real pipeline, store and buckets; only the
reactor's timers are recorded instead of run (`_Reactor`).
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, cast

import pytest

from dpu_agent import status
from dpu_agent.dataplane import pipeline
from dpu_agent.dataplane.regions import RegionTable
from dpu_agent.dataplane.volumes import TenantVolumes
from dpu_agent.storage import DataServices, MemoryVolumeStore, QosLimits
from dpu_wire import capsule
from dpu_wire.capsule import Span, State
from dpu_wire.jobkinds import FLAG_FUA, FLAG_INLINE, JobKind
from tests.links import NoStaging, RecordingLink, StandInHooks

if TYPE_CHECKING:
    from collections.abc import Callable

    from dpu_agent.dataplane import runners
    from dpu_agent.dataplane.reactor import Reactor
    from dpu_agent.dataplane.staging import Staging
    from dpu_wire.transport.base import AgentLink

MiB = 1 << 20
BLOCK = bytes(range(256)) * 16  # one 4 KiB block
LIMIT = 10  # write IOPS: a burst of 10 at once, then one write each 0.1 s
WAITING = 20  # writes past the burst: they wait 0.1 s, 0.2 s, ... 2.0 s


class _Reactor:
    """Records timers (seconds, call); `fire` runs those of some length, `call` is dropped."""

    def __init__(self) -> None:
        self.timers: list[tuple[float, Callable[[], None], types.SimpleNamespace]] = []

    def wake(self, _link: object) -> None:
        pass

    def call(self, _fn: Callable[[], None]) -> None:
        pass  # the end of a close: the link's teardown, nothing of the jobs

    def call_later(self, seconds: float, fn: Callable[[], None]) -> types.SimpleNamespace:
        timer = types.SimpleNamespace(cancelled=False)
        timer.cancel = lambda: setattr(timer, "cancelled", True)
        self.timers.append((seconds, fn, timer))
        return timer

    def waits(self) -> list[float]:
        """The QoS waits set and not cancelled (every timer but the deadline sweeper)."""
        return [s for s, _, t in self.timers if s != pipeline.SWEEP_S and not t.cancelled]

    def fire(self, sweeper_only: bool = False) -> None:
        timers, self.timers = self.timers, []
        for seconds, fn, timer in timers:
            if not timer.cancelled and (seconds == pipeline.SWEEP_S or not sweeper_only):
                fn()


def _link() -> RecordingLink:
    link = RecordingLink()
    link.inline_max = 4096  # the writes carry their block inline
    return link


def _session(store: MemoryVolumeStore, reactor: _Reactor) -> pipeline.Pipeline:
    return pipeline.Pipeline(
        hooks=cast("pipeline.SessionHooks", StandInHooks({1: "v"})),
        link=cast("AgentLink", _link()),
        reactor=cast("Reactor", reactor),
        staging=cast("Staging", NoStaging()),
        regions=RegionTable(),
        storage=cast("runners.Storage", TenantVolumes(store, "t")),
        queue_depth=64,
        default_deadline=30.0,
    )


def _write(job_id: int, *, fua: bool = False) -> memoryview:
    submit = capsule.pack_submit(
        job_id, JobKind.VOLUME_WRITE, Span(0, len(BLOCK), 0), offset=job_id * 4096, handle=1,
        flags=FLAG_INLINE | (FLAG_FUA if fua else 0),
    )  # fmt: skip
    return memoryview(submit + BLOCK)


def _cancel(job_id: int) -> memoryview:
    return memoryview(capsule.Cancel(job_id).encode())


@pytest.mark.parametrize("ending", ["CANCEL capsule", "CancelJob", "deadline", "session end"])
@pytest.mark.parametrize("fua", [False, True], ids=["queued write", "runner"])
def test_writes_that_end_while_throttled_leave_no_debt(ending, fua):
    store = MemoryVolumeStore()
    store.create("v", MiB, 4096, DataServices(), tenant="t", qos=QosLimits(write_iops=LIMIT))
    reactor = _Reactor()
    first = _session(store, reactor)
    for job_id in range(1, LIMIT + 1):  # the burst: no wait, written at the pass's end
        first.on_capsule(_write(job_id))
    first.end_pass()
    waiting = range(LIMIT + 1, LIMIT + WAITING + 1)
    for job_id in waiting:
        first.on_capsule(_write(job_id, fua=fua))
    assert sorted(reactor.waits()) == pytest.approx([i / LIMIT for i in range(1, 21)], abs=0.05)

    if ending == "CANCEL capsule":
        for job_id in waiting:
            first.on_capsule(_cancel(job_id))
    elif ending == "CancelJob":  # the RPC's call on the reactor (`Session.cancel`)
        for job_id in waiting:
            first.cancel(job_id, "cancelled by request")
    elif ending == "deadline":
        for job_id in waiting:
            first.open[job_id].deadline = 0.0  # passed while it waited
        reactor.fire(sweeper_only=True)
    else:
        first.close(State.CANCELLED, status.CANCELLED, "session closed", lambda: None)
    first.end_pass()
    assert not first.open
    assert reactor.waits() == []  # no waiting write is left to run
    reactor.fire()  # what is left: nothing of the ended jobs may run
    first.end_pass()
    assert store.stats("v").write_ops == LIMIT  # the ended writes never reached the volume

    second = _session(store, reactor)  # another session of the tenant, same volume
    second.on_capsule(_write(99))
    (wait,) = reactor.waits()
    # the debt is the burst's alone: one write's turn (0.1 s), not 21 (2.1 s)
    assert wait < 2 / LIMIT, f"a fresh write waits {wait:.2f} s for {WAITING} writes never done"

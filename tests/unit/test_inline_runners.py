"""Runners that use an inline source where it is (`runners.BUFFERLESS_INLINE`).

A CRC-32C or a volume write whose source came in the SUBMIT takes no staging buffer
and copies nothing: the runner reads `JobRecord.inline`. Jobs of these kinds with a
READ source, and inline jobs of kinds that WRITE back (copy), still take a buffer.
End to end over tcp: tests/integration/test_inline_sources.py.
"""

from __future__ import annotations

import os
import types
from typing import TYPE_CHECKING, cast

import crc32c
import pytest

from dpu_agent.dataplane import pipeline, runners
from dpu_agent.dataplane.jobs import JobRecord, Origin
from dpu_agent.dataplane.regions import RegionTable
from dpu_agent.errors import InvalidArgument
from dpu_agent.storage.qos import NO_WAIT, Reservation
from dpu_wire import capsule
from dpu_wire.capsule import Span, State
from dpu_wire.jobkinds import FLAG_FUA, FLAG_INLINE, JobKind
from dpu_wire.transport.base import TransportError
from tests.links import NoStaging, StandInHooks

if TYPE_CHECKING:
    from collections.abc import Callable

    from dpu_agent.dataplane.reactor import Reactor
    from dpu_agent.dataplane.staging import Staging
    from dpu_wire.transport.base import AgentLink

DATA = os.urandom(4096)


def _job(kind: JobKind, *, inline: bool, fua: bool = False) -> JobRecord:
    source = Span(0, len(DATA), 0) if inline else Span(0x1000, len(DATA), 7)
    destination = Span(0x9000, len(DATA), 8) if kind is JobKind.COPY else Span()
    return JobRecord(
        1, kind, source, destination, Origin.CAPSULE, 1e12,
        volume_id="v" if kind is JobKind.VOLUME_WRITE else "",
        offset=8192, fua=fua, inline=DATA if inline else b"",
    )  # fmt: skip


class _Store:
    """Records what the runner asks of the store."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, int, bytes, bool]] = []

    def throttle(self, _volume_id: str, _op: str, _nbytes: int) -> Reservation:
        return NO_WAIT

    def write(self, volume_id: str, offset: int, data: memoryview, *, fua: bool) -> None:
        self.writes.append((volume_id, offset, bytes(data), fua))


def _storage(store: _Store) -> runners.Storage:
    return cast("runners.Storage", store)  # the runner calls only throttle and write


@pytest.mark.parametrize("kind", [JobKind.CRC32C, JobKind.VOLUME_WRITE])
def test_an_inline_source_needs_no_buffer_and_a_read_one_does(kind):
    assert runners.buffers_needed(_job(kind, inline=True)) == (0, 0)
    assert runners.buffers_needed(_job(kind, inline=False)) == (len(DATA), 1)


def test_an_inline_copy_still_takes_a_buffer_for_its_write():
    assert runners.buffers_needed(_job(JobKind.COPY, inline=True)) == (len(DATA), 1)


def test_an_inline_crc_is_computed_from_the_inline_bytes():
    job = _job(JobKind.CRC32C, inline=True)
    gen = runners.crc32c(job, [], None)
    with pytest.raises(StopIteration):
        next(gen)  # no READ, no Work: done at once
    assert job.result == crc32c.crc32c(DATA)
    assert job.bytes_read == len(DATA)


def test_an_inline_volume_write_hands_the_inline_bytes_to_the_store():
    job = _job(JobKind.VOLUME_WRITE, inline=True)
    op = next(runners.volume_write(job, [], _storage(_Store())))
    assert isinstance(op, runners.BatchWrite)
    assert (op.volume_id, op.offset, bytes(op.view)) == ("v", 8192, DATA)
    assert job.bytes_read == len(DATA)


def test_an_inline_fua_write_is_one_durable_store_call():
    store = _Store()
    job = _job(JobKind.VOLUME_WRITE, inline=True, fua=True)
    gen = runners.volume_write(job, [], _storage(store))
    op = next(gen)
    assert isinstance(op, runners.Io)
    assert op.blocking
    op.fn()
    assert store.writes == [("v", 8192, DATA, True)]
    with pytest.raises(StopIteration):
        gen.send(None)


class _Link:
    """The link side of a pipeline: records the capsules it is asked to send."""

    inline_max = 4096

    def __init__(self, room: int = 8) -> None:
        self.sent: list[bytes] = []
        self._room = room

    def room(self) -> int:
        return self._room

    def post_send(self, capsule: bytes, _token: int | None = None) -> None:
        self.sent.append(bytes(capsule))

    def flush(self) -> None:
        pass

    def fast_regions(self, _regions: list[tuple[int, int, int]], _sink: object) -> bool:
        return False  # no native core: every capsule goes through the pipeline


class _Reactor:
    """Records the timers a pipeline sets (call `fire` to run them)."""

    def __init__(self) -> None:
        self.timers: list[tuple[float, Callable[[], None], types.SimpleNamespace]] = []

    def wake(self, _link: object) -> None:
        pass

    def call_later(self, seconds: float, fn: Callable[[], None]) -> types.SimpleNamespace:
        timer = types.SimpleNamespace(cancelled=False)
        timer.cancel = lambda: setattr(timer, "cancelled", True)
        self.timers.append((seconds, fn, timer))
        return timer

    def pending(self, seconds: float) -> int:
        """Timers of `seconds` neither fired nor cancelled."""
        return sum(1 for s, _, timer in self.timers if s == seconds and not timer.cancelled)

    def fire(self) -> None:
        timers, self.timers = self.timers, []
        for _, fn, timer in timers:
            if not timer.cancelled:
                fn()


class _BatchStore:
    """The store side of a pipeline: records each write_batch; throttles and fails on request."""

    def __init__(self, delay: float = 0.0, error: Exception | None = None) -> None:
        self.batches: list[list[tuple[str, int, bytes]]] = []
        self.delay = delay
        self.error = error

    def throttle(self, _volume_id: str, _op: str, _nbytes: int) -> Reservation:
        return Reservation(self.delay)

    def write_batch(self, writes: list[tuple[str, int, memoryview]]) -> list[Exception | None]:
        self.batches.append([(v, o, bytes(d)) for v, o, d in writes])
        return [self.error] * len(writes)


def _pipeline(
    link: _Link,
    hooks: StandInHooks,
    queue_depth: int = 4,
    *,
    reactor: _Reactor | None = None,
    store: _BatchStore | None = None,
) -> pipeline.Pipeline:
    return pipeline.Pipeline(
        hooks=cast("pipeline.SessionHooks", hooks),
        link=cast("AgentLink", link),
        reactor=cast("Reactor", reactor or _Reactor()),
        staging=cast("Staging", NoStaging()),
        regions=RegionTable(),
        storage=cast("runners.Storage", store),
        queue_depth=queue_depth,
        default_deadline=30.0,
    )


def _inline_crc(job_id: int) -> memoryview:
    submit = capsule.pack_submit(job_id, JobKind.CRC32C, Span(0, len(DATA), 0), flags=FLAG_INLINE)
    return memoryview(submit + DATA)


def test_an_inline_crc_job_finishes_in_one_call_without_a_runner(monkeypatch):
    """`runners.IMMEDIATE`: no run, no generator; the same COMPLETION the runner gives."""

    def no_runner(*_args: object) -> None:
        raise AssertionError("the CRC runner was stepped")

    monkeypatch.setitem(runners.RUNNERS, JobKind.CRC32C, no_runner)
    link, hooks = _Link(), StandInHooks({1: "v"})
    pipe = _pipeline(link, hooks)
    pipe.on_capsule(_inline_crc(7))
    (reply,) = link.sent
    fields = capsule.completion_fields(reply)
    assert fields[:6] == (7, State.SUCCEEDED, 0, len(DATA), 0, crc32c.crc32c(DATA))
    assert not pipe.open
    pipe.end_pass()
    assert [job.job_id for job in hooks.published] == [7]


@pytest.mark.parametrize("queue_depth", [1, 100])
def test_completions_the_host_does_not_take_are_bounded(queue_depth):
    """DP-2.6-6: max(1024, 16 x queue_depth) COMPLETIONs wait for a full link; one more
    ends the data plane (each job's slot is free once its COMPLETION is queued)."""
    link, hooks = _Link(room=0), StandInHooks({1: "v"})
    pipe = _pipeline(link, hooks, queue_depth)
    bound = max(1024, 16 * queue_depth)
    for job_id in range(1, bound + 1):
        pipe.on_capsule(_inline_crc(job_id))
    assert str(hooks.failure) == "None"  # not failed yet
    pipe.on_capsule(_inline_crc(bound + 1))
    assert "takes no COMPLETIONs" in str(hooks.failure)
    assert pipe.failed
    assert link.sent == []


def _inline_write(job_id: int, *, fua: bool = False, deadline_ms: int = 0) -> memoryview:
    submit = capsule.pack_submit(
        job_id, JobKind.VOLUME_WRITE, Span(0, len(DATA), 0), offset=8192, handle=1,
        flags=FLAG_INLINE | (FLAG_FUA if fua else 0), deadline_ms=deadline_ms,
    )  # fmt: skip
    return memoryview(submit + DATA)


def _replies(link: _Link) -> list[tuple[int, int, int, int]]:
    """(job id, state, status, bytes_read) of each COMPLETION sent."""
    return [capsule.completion_fields(reply)[:4] for reply in link.sent]


def _no_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_runner(*_args: object) -> None:
        raise AssertionError("the volume write runner was stepped")

    monkeypatch.setitem(runners.RUNNERS, JobKind.VOLUME_WRITE, no_runner)


def test_small_inline_writes_share_one_store_call_without_a_runner(monkeypatch):
    """`runners.queued_write`: the pass's writes go to one write_batch, in order; each job
    ends with its result."""
    _no_runner(monkeypatch)
    link, hooks, store = _Link(), StandInHooks({1: "v"}), _BatchStore()
    pipe = _pipeline(link, hooks, store=store)
    pipe.on_capsule(_inline_write(1))
    pipe.on_capsule(_inline_write(2))
    assert link.sent == []  # nothing ends before the pass's batch
    pipe.end_pass()
    assert store.batches == [[("v", 8192, DATA), ("v", 8192, DATA)]]
    assert _replies(link) == [(1, State.SUCCEEDED, 0, len(DATA)), (2, State.SUCCEEDED, 0, 4096)]
    assert [job.job_id for job in hooks.published] == [1, 2]


def test_a_queued_write_the_store_refuses_fails_with_its_status(monkeypatch):
    _no_runner(monkeypatch)
    link, store = _Link(), _BatchStore(error=InvalidArgument("past the end"))
    pipe = _pipeline(link, StandInHooks({1: "v"}), store=store)
    pipe.on_capsule(_inline_write(1))
    pipe.end_pass()
    assert _replies(link) == [(1, State.FAILED, 3, len(DATA))]
    assert capsule.completion_fields(link.sent[0])[-1] == "past the end"


def test_a_fua_write_still_takes_its_runner(monkeypatch):
    _no_runner(monkeypatch)
    link, store = _Link(), _BatchStore()
    pipe = _pipeline(link, StandInHooks({1: "v"}), store=store)
    with pytest.raises(AssertionError, match="runner was stepped"):
        pipe.on_capsule(_inline_write(1, fua=True))


@pytest.mark.parametrize("ending", ["cancel", "cancel in the same pass", "deadline"])
def test_a_queued_write_that_ends_first_writes_nothing(monkeypatch, ending):
    """A write held by QoS (or not yet in the pass's batch) that is cancelled or passes
    its deadline ends once, with that status, and never reaches the store."""
    _no_runner(monkeypatch)
    link, reactor = _Link(), _Reactor()
    store = _BatchStore(delay=0.0 if ending == "cancel in the same pass" else 0.5)
    pipe = _pipeline(link, StandInHooks({1: "v"}), reactor=reactor, store=store)
    pipe.on_capsule(_inline_write(1, deadline_ms=1))
    if ending == "deadline":
        pipe.open[1].deadline = 0.0  # passed while it waited
    else:
        pipe.cancel(1, "cancelled by request")
    reactor.fire()
    pipe.end_pass()
    reactor.fire()
    pipe.end_pass()
    assert store.batches == []
    status = 4 if ending == "deadline" else 1
    (reply,) = _replies(link)
    state = State.FAILED if ending == "deadline" else State.CANCELLED
    # as the runner's: the inline source counts as read once QoS let the write through
    read = len(DATA) if ending == "cancel in the same pass" else 0
    assert reply == (1, state, status, read)


def test_cancelled_writes_waiting_for_qos_leave_no_timer(monkeypatch):
    """A write waiting for its volume's QoS holds its data in a timer: ending the job
    (CANCEL, the session's end) cancels it, so a host that sends throttled writes and
    cancels them leaves nothing behind."""
    _no_runner(monkeypatch)
    link, reactor = _Link(), _Reactor()
    pipe = _pipeline(link, StandInHooks({1: "v"}), reactor=reactor, store=_BatchStore(delay=3600.0))
    for job_id in range(1, 101):
        pipe.on_capsule(_inline_write(job_id))
        pipe.cancel(job_id, "cancelled by request")
    pipe.on_capsule(_inline_write(101))
    assert reactor.pending(3600.0) == 1  # the one still open
    pipe.fail(TransportError("the link broke"))  # every open job ends, as on close
    assert reactor.pending(3600.0) == 0


def test_a_trim_waits_for_its_write_operation_under_qos():
    """A VOLUME_TRIM is one write operation of no bytes for the volume's QoS (storage.proto)."""
    asked = []

    class Throttled(_Store):
        def throttle(self, volume_id: str, op: str, nbytes: int) -> Reservation:
            asked.append((volume_id, op, nbytes))
            return Reservation(0.25)

    job = JobRecord(
        1, JobKind.VOLUME_TRIM, Span(), Span(), Origin.CAPSULE, 1e12,
        volume_id="v", offset=0, length=4096,
    )  # fmt: skip
    op = next(runners.volume_trim(job, [], _storage(Throttled())))
    assert op == runners.Sleep(0.25)
    assert asked == [("v", "write", 0)]

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
from dpu_wire import capsule
from dpu_wire.capsule import Span, State
from dpu_wire.jobkinds import FLAG_INLINE, JobKind

if TYPE_CHECKING:
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

    def throttle(self, _volume_id: str, _op: str, _nbytes: int) -> float:
        return 0.0

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


class _Hooks:
    """The session side of a pipeline: records the jobs it publishes and its failure."""

    def __init__(self) -> None:
        self.published: list[JobRecord] = []
        self.failure: Exception | None = None

    def check_accepting(self) -> None:
        pass

    def finished(self, jobs: list[JobRecord]) -> None:
        self.published.extend(jobs)

    def data_plane_failed(self, error: Exception) -> None:
        self.failure = error


def _pipeline(link: _Link, hooks: _Hooks, queue_depth: int = 4) -> pipeline.Pipeline:
    reactor = types.SimpleNamespace(wake=lambda _link: None, call_later=lambda *_a: None)
    return pipeline.Pipeline(
        hooks=cast("pipeline.SessionHooks", hooks),
        link=cast("AgentLink", link),
        reactor=cast("Reactor", reactor),
        staging=cast("Staging", None),
        regions=RegionTable(),
        storage=None,
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
    link, hooks = _Link(), _Hooks()
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
    link, hooks = _Link(room=0), _Hooks()
    pipe = _pipeline(link, hooks, queue_depth)
    bound = max(1024, 16 * queue_depth)
    for job_id in range(1, bound + 1):
        pipe.on_capsule(_inline_crc(job_id))
    assert str(hooks.failure) == "None"  # not failed yet
    pipe.on_capsule(_inline_crc(bound + 1))
    assert "takes no COMPLETIONs" in str(hooks.failure)
    assert pipe.failed
    assert link.sent == []

"""WatchCompletions streams as the bus feeds them: a stream that stops reading is bounded."""

import asyncio

import pytest

from dpu_agent.dataplane.bus import WATCHER_BACKLOG, Watcher
from dpu_agent.dataplane.jobs import JobRecord, Origin
from dpu_wire.capsule import JobKind, Span


def record(job_id: int) -> JobRecord:
    return JobRecord(job_id, JobKind.CRC32C, Span(), Span(), Origin.CAPSULE, 0.0)


def job_id(job: JobRecord | None) -> int:
    assert job is not None
    return job.job_id


@pytest.mark.asyncio
async def test_a_stream_that_falls_behind_drops_what_it_holds_and_ends():
    watcher = Watcher(asyncio.get_running_loop())
    watcher.put_many([record(i) for i in range(WATCHER_BACKLOG)])
    assert (watcher.queue.qsize(), watcher.overflowed) == (WATCHER_BACKLOG, False)
    watcher.put(record(WATCHER_BACKLOG))
    # it ends, and nothing of what it held is kept for a reader that may never come back
    assert (watcher.overflowed, watcher.queue.qsize()) == (True, 1)
    assert await watcher.queue.get() is None
    watcher.put_many([record(i) for i in range(10)])  # later jobs are not queued either
    watcher.put(None)
    assert watcher.queue.empty()


@pytest.mark.asyncio
async def test_a_stream_that_keeps_up_gets_every_job_then_the_end():
    watcher = Watcher(asyncio.get_running_loop())
    for chunk in range(4):
        watcher.put_many([record(chunk * WATCHER_BACKLOG + i) for i in range(WATCHER_BACKLOG)])
        got = [job_id(watcher.queue.get_nowait()) for _ in range(WATCHER_BACKLOG)]
        assert got == list(range(chunk * WATCHER_BACKLOG, (chunk + 1) * WATCHER_BACKLOG))
    watcher.put(None)
    assert not watcher.overflowed
    assert watcher.queue.get_nowait() is None

"""The data-plane acceptance scenario, shared by the tcp (host) and verbs (VM) suites.

N jobs of mixed kinds and sizes (log-uniform 4 KiB..4 MiB) run through one session
from W concurrent workers; every copied byte and every CRC is checked, and a second
WatchCompletions stream must see every job exactly once.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import os
import random
from typing import TYPE_CHECKING

import crc32c

from dpu_wire.v1 import job_pb2

if TYPE_CHECKING:
    import host_client

MIN_SIZE = 4 << 10
MAX_SIZE = 4 << 20


@dataclasses.dataclass
class Report:
    """What the scenario saw."""

    jobs: int = 0
    copies: int = 0
    crcs: int = 0
    bytes_checked: int = 0
    completions: collections.Counter[int] = dataclasses.field(default_factory=collections.Counter)
    watched: collections.Counter[int] = dataclasses.field(default_factory=collections.Counter)


def sizes(n: int, rng: random.Random) -> list[int]:
    """Log-uniform sizes from 4 KiB to 4 MiB, both ends included."""
    lo, hi = math.log(MIN_SIZE), math.log(MAX_SIZE)
    out = [int(math.exp(rng.uniform(lo, hi))) for _ in range(n)]
    out[0], out[-1] = MIN_SIZE, MAX_SIZE
    return out


async def _watch(
    client: host_client.Client, session: str, report: Report, stop: asyncio.Event
) -> None:
    stream = client.stubs.jobs.WatchCompletions(job_pb2.WatchCompletionsRequest(session=session))
    await stream.wait_for_connection()
    stop.set()  # the stream is in place
    async for completion in stream:
        report.watched[completion.job_id] += 1


async def run(
    client: host_client.Client,
    *,
    transport: str,
    jobs: int = 1000,
    workers: int = 16,
    seed: int = 7,
    rpc_every: int = 10,
) -> Report:
    """Run the scenario; raise AssertionError on the first wrong byte or CRC."""
    rng = random.Random(seed)  # noqa: S311 - test data, not secrets
    plan = sizes(jobs, rng)
    report = Report()
    async with await client.open_session(transport=transport, queue_depth=workers) as session:
        source = await session.alloc(MAX_SIZE, readable=True)
        source.view[:] = os.urandom(MAX_SIZE)
        targets = [await session.alloc(MAX_SIZE, writable=True) for _ in range(workers)]
        ready = asyncio.Event()
        watcher = asyncio.create_task(_watch(client, session.name, report, ready))
        await ready.wait()
        queue: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        for index, size in enumerate(plan):
            queue.put_nowait((index, size))

        async def worker(target: host_client.Buffer) -> None:
            while not queue.empty():
                index, size = queue.get_nowait()
                offset = rng.randrange(0, MAX_SIZE - size + 1)
                src = source[offset : offset + size]
                use_rpc = index % rpc_every == 0
                if index % 2 == 0:
                    dst_offset = rng.randrange(0, MAX_SIZE - size + 1)
                    dst = target[dst_offset : dst_offset + size]
                    if use_rpc:
                        job = await session.submit_rpc("copy", src, dst)
                    else:
                        job = await session.submit_copy(src, dst)
                    done = (await job).raise_for_status()
                    assert done.bytes_read == done.bytes_written == size
                    got = target.view[dst_offset : dst_offset + size]
                    want = source.view[offset : offset + size]
                    assert got == want, f"job {job.job_id}: copied bytes differ"
                    report.copies += 1
                else:
                    if use_rpc:
                        job = await session.submit_rpc("crc32c", src)
                    else:
                        job = await session.submit_crc32c(src)
                    done = (await job).raise_for_status()
                    want_crc = crc32c.crc32c(source.view[offset : offset + size])
                    assert done.crc32c == want_crc, f"job {job.job_id}: crc differs"
                    report.crcs += 1
                report.completions[done.job_id] += 1
                report.bytes_checked += size
                report.jobs += 1

        await asyncio.gather(*(worker(t) for t in targets))
        # every completion the watch stream owes has been sent before the last
        # completion reached us; give the stream a moment to deliver, bounded.
        for _ in range(200):
            if len(report.watched) >= report.jobs:
                break
            await asyncio.sleep(0.05)
        watcher.cancel()
    return report

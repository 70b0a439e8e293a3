"""One load-generating host process: several asyncio clients, each with its own session.

    python -m tests.faults.load_client ADDRESS TRANSPORT CLIENTS JOBS SEED [RDMA_DEVICE]

Each client opens a `host_client.Client`, a session (queue depth `QUEUE_DEPTH`), a
volume of its own, and a WatchCompletions stream of every job of its session; then
`WORKERS` tasks run JOBS jobs between them: copies and CRC32Cs (log-uniform sizes,
by capsule and by SubmitJob) and volume writes each followed by a read of the same
range (by capsule and by SubmitJob). Every copied byte, every CRC and every byte read
back from the volume is checked. Each job id must complete exactly once, and appear
exactly once on the watch stream. The process prints one JSON line with the totals
and exits 0, or prints the first failure to stderr and exits 1.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import math
import os
import random
import sys
import time

import crc32c

import host_client
from dpu_wire.v1 import job_pb2

QUEUE_DEPTH = 8
WORKERS = 4
MIN_SIZE = 512
MAX_SIZE = 256 << 10
BLOCK = 4096
VOLUME_SLOT = 64 << 10  # each worker writes its own slots of the volume
SLOTS_PER_WORKER = 16
WATCH_WAIT = 30.0


@dataclasses.dataclass
class Totals:
    """What one client (or the whole process) did and saw."""

    jobs: int = 0
    copies: int = 0
    crcs: int = 0
    volume_writes: int = 0
    volume_reads: int = 0
    rpc_jobs: int = 0
    bytes_checked: int = 0
    duplicate_completions: int = 0
    lost_on_watch: int = 0
    duplicate_on_watch: int = 0
    unknown_on_watch: int = 0

    def add(self, other: Totals) -> None:
        """Add another client's numbers."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


class LoadClient:
    """One client: its session, buffers, volume and the jobs it still has to run."""

    def __init__(self, session: host_client.Session, volume: str, jobs: int, seed: int) -> None:
        self.session = session
        self.volume = volume
        self.remaining = jobs
        self.rng = random.Random(seed)  # noqa: S311 - test data, not secrets
        self.totals = Totals()
        self.completed: collections.Counter[int] = collections.Counter()
        self.watched: collections.Counter[int] = collections.Counter()
        self.source: host_client.Buffer
        self.source_bytes = b""
        self.targets: list[host_client.Buffer] = []
        self.latencies_us: list[int] = []  # per job, submit to checked completion

    async def setup(self) -> None:
        """Register the buffers: one source, one target per worker."""
        self.source = await self.session.alloc(MAX_SIZE, readable=True)
        self.source_bytes = os.urandom(MAX_SIZE)
        self.source.view[:] = self.source_bytes
        for _ in range(WORKERS):
            self.targets.append(await self.session.alloc(MAX_SIZE, readable=True, writable=True))

    def size(self) -> int:
        """A log-uniform size from MIN_SIZE to MAX_SIZE."""
        lo, hi = math.log(MIN_SIZE), math.log(MAX_SIZE)
        return int(math.exp(self.rng.uniform(lo, hi)))

    def done(self, completion: host_client.Completion) -> host_client.Completion:
        """Count a completion (raising if the job failed)."""
        completion.raise_for_status()
        self.completed[completion.job_id] += 1
        self.totals.jobs += 1
        return completion

    async def run_worker(self, worker: int) -> None:
        """Take jobs until none remain."""
        target = self.targets[worker]
        while self.remaining > 0:
            pick = self.rng.random()
            by_rpc = self.rng.random() < 0.3
            started = time.perf_counter_ns()
            if pick >= 0.7 and self.remaining >= 2:
                self.remaining -= 2  # a write and its read
                self.totals.rpc_jobs += 2 * by_rpc
                await self.volume_round_trip(worker, target, by_rpc=by_rpc)
                half = (time.perf_counter_ns() - started) // 2000
                self.latencies_us += (half, half)
                continue
            self.remaining -= 1
            self.totals.rpc_jobs += by_rpc
            if pick < 0.35:
                await self.copy(target, by_rpc=by_rpc)
            else:
                await self.crc(by_rpc=by_rpc)
            self.latencies_us.append((time.perf_counter_ns() - started) // 1000)

    async def copy(self, target: host_client.Buffer, *, by_rpc: bool) -> None:
        """Copy a random part of the source into the target; compare the bytes."""
        size = self.size()
        at = self.rng.randrange(0, MAX_SIZE - size + 1)
        to = self.rng.randrange(0, MAX_SIZE - size + 1)
        src, dst = self.source[at : at + size], target[to : to + size]
        if by_rpc:
            job = await self.session.submit_rpc("copy", src, dst)
        else:
            job = await self.session.submit_copy(src, dst)
        done = self.done(await job)
        assert done.bytes_read == done.bytes_written == size, done
        assert target.view[to : to + size] == self.source_bytes[at : at + size], (
            f"job {job.job_id}: copied bytes differ"
        )
        self.totals.copies += 1
        self.totals.bytes_checked += size

    async def crc(self, *, by_rpc: bool) -> None:
        """CRC32C of a random part of the source on the agent; compare with ours."""
        size = self.size()
        at = self.rng.randrange(0, MAX_SIZE - size + 1)
        src = self.source[at : at + size]
        if by_rpc:
            job = await self.session.submit_rpc("crc32c", src)
        else:
            job = await self.session.submit_crc32c(src)
        done = self.done(await job)
        want = crc32c.crc32c(self.source_bytes[at : at + size])
        assert done.crc32c == want, f"job {job.job_id}: crc32c differs"
        self.totals.crcs += 1
        self.totals.bytes_checked += size

    async def volume_round_trip(
        self, worker: int, target: host_client.Buffer, *, by_rpc: bool
    ) -> None:
        """Write fresh data to one of this worker's volume slots, read it back, compare."""
        size = self.rng.randrange(1, VOLUME_SLOT // BLOCK + 1) * BLOCK
        slot = worker * SLOTS_PER_WORKER + self.rng.randrange(SLOTS_PER_WORKER)
        offset = slot * VOLUME_SLOT
        data = os.urandom(size)
        target.view[:size] = data
        if by_rpc:
            spec = job_pb2.JobSpec()
            spec.volume_write.volume = self.volume
            spec.volume_write.offset = offset
            spec.volume_write.source.CopyFrom(target[0:size].region_ref())
            job = await self.session.submit_spec(spec)
        else:
            job = await self.session.submit_volume_write(self.volume, offset, target[0:size])
        self.done(await job)
        self.totals.volume_writes += 1
        target.view[:size] = bytes(size)
        if by_rpc:
            spec = job_pb2.JobSpec()
            spec.volume_read.volume = self.volume
            spec.volume_read.offset = offset
            spec.volume_read.destination.CopyFrom(target[0:size].region_ref())
            job = await self.session.submit_spec(spec)
        else:
            job = await self.session.submit_volume_read(self.volume, offset, target[0:size])
        self.done(await job)
        assert target.view[:size] == data, f"job {job.job_id}: volume bytes differ"
        self.totals.volume_reads += 1
        self.totals.bytes_checked += size


async def _watch(
    client: host_client.Client, session: str, seen: collections.Counter[int], ready: asyncio.Event
) -> None:
    stream = client.stubs.jobs.WatchCompletions(job_pb2.WatchCompletionsRequest(session=session))
    await stream.wait_for_connection()
    ready.set()
    async for completion in stream:
        seen[completion.job_id] += 1


async def one_client(
    address: str, transport: str, jobs: int, seed: int, index: int, device: str | None
) -> tuple[Totals, list[int]]:
    """Run one client's share; return its checked totals and its jobs' latencies (us)."""
    volume_id = f"load-{seed}-{index}"
    async with host_client.Client(address, timeout=120) as client:
        size = WORKERS * SLOTS_PER_WORKER * VOLUME_SLOT
        await client.create_volume(volume_id, size, crc32c=True)
        session = await client.open_session(
            transport=transport, queue_depth=QUEUE_DEPTH, rdma_device=device
        )
        async with session:
            load = LoadClient(session, f"volumes/{volume_id}", jobs, seed * 1000 + index)
            await load.setup()
            ready = asyncio.Event()
            watcher = asyncio.create_task(_watch(client, session.name, load.watched, ready))
            await ready.wait()
            await asyncio.gather(*(load.run_worker(w) for w in range(WORKERS)))
            async with asyncio.timeout(WATCH_WAIT):  # the stream owes what already completed
                while set(load.watched) < set(load.completed):  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            watcher.cancel()
        await client.delete_volume(f"volumes/{volume_id}")
    totals = load.totals
    totals.duplicate_completions = sum(n - 1 for n in load.completed.values() if n > 1)
    totals.lost_on_watch = len(set(load.completed) - set(load.watched))
    totals.duplicate_on_watch = sum(n - 1 for n in load.watched.values() if n > 1)
    totals.unknown_on_watch = len(set(load.watched) - set(load.completed))
    return totals, load.latencies_us


async def main(argv: list[str]) -> tuple[Totals, list[int]]:
    """Run CLIENTS clients concurrently; return the sum of their totals, every latency."""
    address, transport, clients, jobs, seed = argv[:5]
    device = argv[5] if len(argv) > 5 else None
    results = await asyncio.gather(
        *(
            one_client(address, transport, int(jobs), int(seed), i, device)
            for i in range(int(clients))
        )
    )
    total = Totals()
    latencies: list[int] = []
    for result, latency in results:
        total.add(result)
        latencies += latency
    return total, latencies


if __name__ == "__main__":
    started = time.monotonic()
    totals, latencies_us = asyncio.run(main(sys.argv[1:]))
    report: dict[str, object] = dataclasses.asdict(totals)
    report["seconds"] = round(time.monotonic() - started, 2)
    report["latencies_us"] = latencies_us
    print(json.dumps(report), flush=True)  # noqa: T201 - the test reads this line

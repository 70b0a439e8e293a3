"""Volume I/O through the agent and the store, each against its reference in the same run.

Through an agent process (file backend, volumes without data services, store on the
same file system as the references), the SDK over the tcp data plane:

- 4 KiB random writes, then reads, at queue depth 1 and 32 (capsule path), against
  os.pwrite/os.pread of 4 KiB at random offsets of a file of the same size in the
  same directory (depth 1, and 32 threads). Neither side syncs per I/O;
- `4 KiB FUA write QD1`: random overwrites with FUA (durable when acknowledged)
  against pwrite+fdatasync QD1 of random overwrites of a written file;
- `4 KiB volume write QD1 p50` and `4 KiB volume read QD1 p50` against the p50 of a
  4 KiB crc32c job at QD1 on the same session: what the store adds to the data
  plane's own floor;
- snapshot creation (CreateSnapshot, durable when it returns) of a 1 GiB and a 64
  GiB sparse volume (each with 16 MiB written across it): the 64 GiB figure's
  reference is the 1 GiB one (time independent of size: ratio ~1), the 1 GiB one's
  a GetVolume call (the floor of any control call).

In-process, the store alone (FileVolumeStore, same file system):

- `4 KiB FUA write QD1, store`: write(fua=True) of random overwrites against
  pwrite+fdatasync, without the data plane;
- `4 KiB write, store CPU` / `4 KiB read, store CPU`: microseconds per non-FUA
  4 KiB write/read of a volume without data services against os.pwrite/os.pread.

The 64 GiB volume needs 64 GiB free on the file system (volumes are thin, but a
volume larger than the free space is refused).
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import host_client
from bench import common
from bench.common import TAIL, Result, agent_process, arun, quick, write_results
from dpu_agent.storage import DataServices, FileVolumeStore

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

BLOCK = 4096
VOLUME = 256 << 20
OPS = quick(3000, 300)  # at QD1; five times as many at QD32 (about a second)
DEPTHS = (1, 32)
FUA_OPS = quick(1000, 100)
P50_OPS = quick(2000, 200)
SNAPSHOTS = quick(30, 3)
SNAPSHOT_SIZES = {"1 GiB": 1 << 30, "64 GiB": 64 << 30}
CPU_OPS = quick(20000, 2000)


def _ops(depth: int) -> int:
    return OPS if depth == 1 else 5 * OPS


def _offsets(seed: int, count: int = OPS, size: int = VOLUME) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(size // BLOCK) * BLOCK for _ in range(count)]


def _p(latencies: list[float], q: float) -> float:
    latencies = sorted(latencies)
    return latencies[max(0, int(len(latencies) * q) - 1)]


def _written_file(path: Path, size: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    chunk = os.urandom(1 << 20)
    for at in range(0, size, len(chunk)):
        os.pwrite(fd, chunk, at)
    os.fsync(fd)
    return fd


# ------------------------------------------------------------------ references


def reference(path: Path, depth: int, *, write: bool) -> tuple[float, float]:
    """(IOPS, p99 us) of pwrite/pread at `depth`."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    os.ftruncate(fd, VOLUME)
    data = os.urandom(BLOCK)
    offsets = _offsets(1, _ops(depth))
    latencies: list[float] = []

    def one(offset: int) -> None:
        start = time.perf_counter_ns()
        if write:
            os.pwrite(fd, data, offset)
        else:
            os.pread(fd, BLOCK, offset)
        latencies.append((time.perf_counter_ns() - start) / 1000)

    start = time.perf_counter()
    if depth == 1:
        for offset in offsets:
            one(offset)
    else:
        with ThreadPoolExecutor(depth) as pool:
            list(pool.map(one, offsets))
    elapsed = time.perf_counter() - start
    os.close(fd)
    return len(offsets) / elapsed, _p(latencies, 0.99)


def settle() -> None:
    """Write back every dirty page first (os.sync).

    A sync-bound loop otherwise waits for whatever the benches before it left in the page
    cache, and the loops it is compared with did not.
    """
    os.sync()


def fdatasync_reference(path: Path, size: int) -> float:
    """IOPS of pwrite+fdatasync QD1, random 4 KiB overwrites of a written file."""
    fd = _written_file(path, size)
    data = os.urandom(BLOCK)
    offsets = _offsets(3, FUA_OPS, size)
    settle()
    try:
        start = time.perf_counter()
        for offset in offsets:
            os.pwrite(fd, data, offset)
            os.fdatasync(fd)
        return FUA_OPS / (time.perf_counter() - start)
    finally:
        os.close(fd)
        path.unlink()


# ------------------------------------------------------------------ through the agent


async def ours(target: str, depth: int, *, write: bool) -> tuple[float, float]:
    """(IOPS, p99 us) of 4 KiB volume jobs through the agent at `depth`."""
    async with (
        host_client.Client(target) as client,
        await client.open_session(transport="tcp", queue_depth=depth) as session,
    ):
        name = f"volumes/bench-{depth}-{int(write)}"
        await client.create_volume(name.removeprefix("volumes/"), VOLUME)
        buffers = [await session.alloc(BLOCK, readable=True, writable=True) for _ in range(depth)]
        for buffer in buffers:
            buffer.view[:] = os.urandom(BLOCK)
        queue = _offsets(1, _ops(depth))
        count = len(queue)
        latencies: list[float] = []

        async def worker(buffer: host_client.Buffer) -> None:
            while queue:
                offset = queue.pop()
                start = time.perf_counter_ns()
                if write:
                    await session.write_volume(name, offset, buffer)
                else:
                    await session.read_volume(name, offset, buffer)
                latencies.append((time.perf_counter_ns() - start) / 1000)

        start = time.perf_counter()
        await asyncio.gather(*(worker(b) for b in buffers))
        elapsed = time.perf_counter() - start
        await client.delete_volume(name)
    return count / elapsed, _p(latencies, 0.99)


async def _timed(count: int, one: Callable[[int], Awaitable[object]]) -> list[float]:
    latencies = []
    for i in range(count):
        start = time.perf_counter_ns()
        await one(i)
        latencies.append((time.perf_counter_ns() - start) / 1000)
    return latencies


async def qd1_figures(target: str, size: int) -> dict[str, float]:
    """FUA IOPS, write/read/crc32c p50 (us), all QD1 on one tcp session."""
    async with (
        host_client.Client(target) as client,
        await client.open_session(transport="tcp", queue_depth=1) as session,
    ):
        name = "volumes/bench-qd1"
        await client.create_volume(name.removeprefix("volumes/"), size)
        big = await session.alloc(1 << 20, readable=True)
        big.view[:] = os.urandom(1 << 20)
        for at in range(0, size, 1 << 20):  # overwrites, as the reference does
            await session.write_volume(name, at, big)
        # Durable before the clock starts, as the reference's file is (else the first FUA
        # write pays for flushing all of it).
        (await (await session.submit_volume_flush(name))).raise_for_status()
        buf = await session.alloc(BLOCK, readable=True, writable=True)
        buf.view[:] = os.urandom(BLOCK)
        fua = _offsets(3, FUA_OPS, size)
        settle()
        start = time.perf_counter()
        for offset in fua:
            await session.write_volume(name, offset, buf, fua=True)
        fua_iops = FUA_OPS / (time.perf_counter() - start)
        offsets = _offsets(4, P50_OPS, size)
        writes = await _timed(P50_OPS, lambda i: session.write_volume(name, offsets[i], buf))
        reads = await _timed(P50_OPS, lambda i: session.read_volume(name, offsets[i], buf))
        crcs = await _timed(P50_OPS, lambda _: session.crc32c(buf))
        await client.delete_volume(name)
    return {
        "fua_iops": fua_iops,
        "write_p50": statistics.median(writes),
        "read_p50": statistics.median(reads),
        "crc_p50": statistics.median(crcs),
    }


async def snapshot_times(target: str) -> dict[str, float]:
    """p50 us of CreateSnapshot per volume size, and of GetVolume."""
    found: dict[str, float] = {}
    async with (
        host_client.Client(target) as client,
        await client.open_session(transport="tcp") as session,
    ):
        buf = await session.alloc(1 << 20, readable=True)
        buf.view[:] = os.urandom(1 << 20)
        for label, size in SNAPSHOT_SIZES.items():
            name = f"bench-snap-{label.replace(' ', '').lower()}"
            await client.create_volume(name, size)
            for at in _offsets(5, 16, size - (1 << 20)):  # 16 MiB across the volume
                await session.write_volume(f"volumes/{name}", at // (1 << 20) * (1 << 20), buf)
            times = []
            for i in range(SNAPSHOTS):
                start = time.perf_counter_ns()
                await client.create_snapshot(f"{name}-{i}", f"volumes/{name}")
                times.append((time.perf_counter_ns() - start) / 1000)
                await session.write_volume(f"volumes/{name}", 0, buf)  # the next has data too
            for i in range(SNAPSHOTS):
                await client.delete_snapshot(f"snapshots/{name}-{i}")
            await client.delete_volume(f"volumes/{name}")
            found[label] = statistics.median(times)
        await client.create_volume("bench-get", 1 << 20)
        gets = await _timed(SNAPSHOTS, lambda _: client.get_volume("volumes/bench-get"))
        await client.delete_volume("volumes/bench-get")
        found["get"] = statistics.median(gets)
    return found


# ------------------------------------------------------------------ the store alone


def store_figures(directory: Path, size: int) -> dict[str, float]:
    """FUA IOPS and CPU us per 4 KiB write/read of the in-process store."""
    data = os.urandom(BLOCK)
    with FileVolumeStore(directory / "store") as store:
        store.create("v", size, BLOCK, DataServices())
        chunk = os.urandom(1 << 20)
        for at in range(0, size, len(chunk)):
            store.write("v", at, chunk)
        store.flush("v")
        offsets = _offsets(3, FUA_OPS, size)
        settle()
        start = time.perf_counter()
        for offset in offsets:
            store.write("v", offset, data, fua=True)
        fua_iops = FUA_OPS / (time.perf_counter() - start)
        offsets = _offsets(6, CPU_OPS, size)
        start = time.process_time()
        for offset in offsets:
            store.write("v", offset, data)
        write_us = (time.process_time() - start) / CPU_OPS * 1e6
        store.flush("v")
        start = time.process_time()
        for offset in offsets:
            store.read("v", offset, BLOCK)
        read_us = (time.process_time() - start) / CPU_OPS * 1e6
    fd = _written_file(directory / "cpu.ref", size)
    try:
        start = time.process_time()
        for offset in offsets:
            os.pwrite(fd, data, offset)
        pwrite_us = (time.process_time() - start) / CPU_OPS * 1e6
        start = time.process_time()
        for offset in offsets:
            os.pread(fd, BLOCK, offset)
        pread_us = (time.process_time() - start) / CPU_OPS * 1e6
    finally:
        os.close(fd)
    return {
        "fua_iops": fua_iops,
        "write_us": write_us,
        "read_us": read_us,
        "pwrite_us": pwrite_us,
        "pread_us": pread_us,
    }


def main() -> list[Result]:
    """Run and write bench/results/storage_io.json."""
    results = []
    with tempfile.TemporaryDirectory() as tmp, agent_process() as target:
        for depth in DEPTHS:
            for write in (True, False):
                op = "write" if write else "read"
                ref_iops, ref_p99 = reference(Path(tmp) / "ref.img", depth, write=write)
                our_iops, our_p99 = arun(ours(target, depth, write=write))
                label = f"4 KiB random {op} QD{depth}"
                ref = f"p{op} QD{depth}"
                results += [
                    Result(f"{label} IOPS", our_iops, ref_iops, "IOPS", ref),
                    Result(
                        f"{label} p99",
                        our_p99,
                        ref_p99,
                        "us",
                        ref,
                        higher_is_better=False,
                        tolerance=TAIL,
                    ),
                ]
        qd1_size = 64 << 20
        sync_iops = fdatasync_reference(Path(tmp) / "sync.img", qd1_size)
        qd1 = arun(qd1_figures(target, qd1_size))
        crc = "4 KiB crc32c job QD1 p50"
        results += [
            Result(
                "4 KiB FUA write QD1", qd1["fua_iops"], sync_iops, "IOPS", "pwrite+fdatasync QD1"
            ),
            Result(
                "4 KiB volume write QD1 p50",
                qd1["write_p50"],
                qd1["crc_p50"],
                "us",
                crc,
                higher_is_better=False,
            ),
            Result(
                "4 KiB volume read QD1 p50",
                qd1["read_p50"],
                qd1["crc_p50"],
                "us",
                crc,
                higher_is_better=False,
            ),
        ]
        snaps = arun(snapshot_times(target))
        results += [
            Result(
                "snapshot creation, 1 GiB volume",
                snaps["1 GiB"],
                snaps["get"],
                "us",
                "GetVolume call",
                higher_is_better=False,
            ),
            Result(
                "snapshot creation, 64 GiB volume",
                snaps["64 GiB"],
                snaps["1 GiB"],
                "us",
                "snapshot creation, 1 GiB volume",
                higher_is_better=False,
            ),
        ]
        store = store_figures(Path(tmp), qd1_size)
        store_sync = fdatasync_reference(Path(tmp) / "sync2.img", qd1_size)
        results += [
            Result(
                "4 KiB FUA write QD1, store",
                store["fua_iops"],
                store_sync,
                "IOPS",
                "pwrite+fdatasync QD1",
            ),
            Result(
                "4 KiB write, store CPU",
                store["write_us"],
                store["pwrite_us"],
                "us",
                "os.pwrite CPU",
                higher_is_better=False,
            ),
            Result(
                "4 KiB read, store CPU",
                store["read_us"],
                store["pread_us"],
                "us",
                "os.pread CPU",
                higher_is_better=False,
            ),
        ]
    write_results("storage_io", results)
    return results


if __name__ == "__main__":
    common.command_line(__doc__)
    main()

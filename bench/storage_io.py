"""4 KiB random volume I/O through the agent vs pread/pwrite on a file, same run.

- ours: an agent process (file backend, no data services, on the same file system),
  the SDK over the tcp data plane: 4 KiB random writes, then reads, at queue depth 1
  and 32 (capsule path: SEND, the agent's READ/WRITE of host memory, the store);
- reference: os.pwrite/os.pread of 4 KiB at random offsets of a file of the same size
  in the same directory, at depth 1 and with 32 threads.
Neither side syncs per I/O (the agent's store writes to the page cache like pwrite).
"""

from __future__ import annotations

import asyncio
import os
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import host_client
from bench.common import TAIL, Result, agent_process, write_results

BLOCK = 4096
VOLUME = 256 << 20
OPS = 3000
DEPTHS = (1, 32)


def _offsets(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOLUME // BLOCK) * BLOCK for _ in range(OPS)]


def reference(path: Path, depth: int, *, write: bool) -> tuple[float, float]:
    """(IOPS, p99 us) of pwrite/pread at `depth`."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    os.ftruncate(fd, VOLUME)
    data = os.urandom(BLOCK)
    offsets = _offsets(1)
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
    latencies.sort()
    return OPS / elapsed, latencies[int(len(latencies) * 0.99) - 1]


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
        queue = list(_offsets(1))
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
    latencies.sort()
    return OPS / elapsed, latencies[int(len(latencies) * 0.99) - 1]


def main() -> list[Result]:
    """Run and write bench/results/storage_io.json."""
    results = []
    with tempfile.TemporaryDirectory() as tmp, agent_process() as target:
        for depth in DEPTHS:
            for write in (True, False):
                op = "write" if write else "read"
                ref_iops, ref_p99 = reference(Path(tmp) / "ref.img", depth, write=write)
                our_iops, our_p99 = asyncio.run(ours(target, depth, write=write))
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
    write_results("storage_io", results)
    return results


if __name__ == "__main__":
    main()

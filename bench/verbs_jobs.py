"""Jobs through the agent over verbs on rxe, vs perftest on the same port, same run.

Agent and host client are separate processes (as in production); the client uses
the SDK. Needs an RDMA device, so `make bench` runs it in the soft-RoCE test VM:

    python3 deploy/testvm/testvm.py run -- .venv/bin/python -m bench.verbs_jobs

- 4 KiB copy-job latency, one job in flight, submit to completion as the SDK sees
  it (capsule SEND, the agent's RDMA READ and RDMA WRITE, completion SEND): p50 and
  p99 vs `ib_write_lat -s 4096` typical and p99 (half a round trip of one WRITE: a
  copy job is two round trips of RDMA plus two SENDs, so expect a ratio well below 1);
- copy-job throughput at 64 KiB and 1 MiB with 16 jobs in flight, bytes the agent
  WROTE per second vs `ib_write_bw` with 16 in flight (each job also READs as much).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time

import host_client
from bench import common
from bench.common import TAIL, Result, agent_process
from bench.verbs_write import IN_FLIGHT, perftest_bw, perftest_lat
from dpu_wire.transport.verbs import find_port

NAME = "verbs_jobs"
LAT_JOBS = 400
BW_SECONDS = 4.0
SIZES = (64 << 10, 1 << 20)
MIB = float(1 << 20)


async def job_latency_us(target: str) -> tuple[float, float]:
    """(p50, p99) of 4 KiB copy jobs, one in flight."""
    async with (
        host_client.Client(target, timeout=60) as client,
        await client.open_session(transport="verbs", queue_depth=4) as session,
    ):
        src = await session.alloc(4096, readable=True)
        dst = await session.alloc(4096, writable=True)
        for _ in range(20):  # warm up
            await session.copy(src, dst)
        samples = []
        for _ in range(LAT_JOBS):
            start = time.perf_counter_ns()
            await session.copy(src, dst)
            samples.append((time.perf_counter_ns() - start) / 1000)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99) - 1]


async def job_throughput_mib_s(target: str, size: int) -> float:
    """MiB/s the agent writes with IN_FLIGHT copy jobs of `size` bytes."""
    async with (
        host_client.Client(target, timeout=60) as client,
        await client.open_session(transport="verbs", queue_depth=IN_FLIGHT) as session,
    ):
        src = await session.alloc(size, readable=True)
        targets = [await session.alloc(size, writable=True) for _ in range(IN_FLIGHT)]
        moved = 0
        start = time.perf_counter()

        async def worker(dst: host_client.Buffer) -> None:
            nonlocal moved
            while time.perf_counter() - start < BW_SECONDS:
                await session.copy(src, dst)
                moved += size

        await asyncio.gather(*(worker(t) for t in targets))
        return moved / (time.perf_counter() - start) / MIB


def measure() -> list[Result]:
    """Interleave each reference with ours on the same port."""
    port = find_port(os.environ.get("DPU_TEST_RDMA_DEVICE"))
    env = {"DPU_AGENT_TRANSPORTS": "verbs", "DPU_AGENT_RDMA_DEVICE": port[0]}
    results = []
    with agent_process(env) as target:
        typical, p99 = perftest_lat(port)
        p50_ours, p99_ours = asyncio.run(job_latency_us(target))
        print(f"4 KiB copy job: p50 {p50_ours:.0f} us, p99 {p99_ours:.0f} us")
        results += [
            Result("4 KiB copy job p50", p50_ours, typical, "us", "ib_write_lat typ", False),
            Result(
                "4 KiB copy job p99", p99_ours, p99, "us", "ib_write_lat p99", False, tolerance=TAIL
            ),
        ]
        for size in SIZES:
            reference = perftest_bw(port, size)
            ours = asyncio.run(job_throughput_mib_s(target, size))
            label = f"{size >> 10} KiB"
            print(f"copy jobs {label} x{IN_FLIGHT}: {ours:.1f} MiB/s written")
            results.append(
                Result(
                    f"copy jobs {label} x{IN_FLIGHT}",
                    ours,
                    reference,
                    "MiB/s",
                    "ib_write_bw",
                    size=size,
                    series=f"copy jobs x{IN_FLIGHT}",
                )
            )
    return results


def main() -> list[Result]:
    """Measure here when there is an RDMA device, else in the soft-RoCE test VM."""
    return common.run_rdma_bench(NAME, measure)


if __name__ == "__main__":
    main()

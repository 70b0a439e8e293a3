"""Jobs through the agent over verbs on rxe, vs perftest and the pyverbs floor, same run.

Agent and host client are separate processes (as in production); the client uses
the SDK. Needs an RDMA device, so `make bench` runs it in the soft-RoCE test VM:

    python3 deploy/testvm/testvm.py run -- .venv/bin/python -m bench.verbs_jobs

- `4 KiB copy job p50` / `p99`: one job in flight, submit to completion as the SDK
  sees it (`Session.run`: the SUBMIT's SEND carrying the 4 KiB source inline, the
  agent's RDMA WRITE, the completion's SEND), against `ib_write_lat -s 4096` typical
  and p99 (half a round trip of one WRITE, so expect a ratio well below 1);
- `4 KiB copy job p50, READ path`: the same with `open_session(inline=False)`: the
  agent RDMA READs the source (one more round trip and post);
- `4 KiB copy job p50, vs the pyverbs floor`: the same job against `bench.pyverbs_floor`
  run with `DPU_NATIVE=0` (the READ path written directly on pyverbs, two processes,
  busy polling: how far pure Python goes on this device), and the floor's own ratio to
  ib_write_lat;
- `4 KiB copy job p50, vs its shape in a bare loop`: the same job against
  `bench.pyverbs_floor --shape inline` (the default job's posts, a 4,176-byte SUBMIT,
  then a WRITE and a COMPLETION in one post, in two bare busy loops on the link's queue
  pair, through the native core when it is built): what the framework adds to its own
  wire shape, and that loop's ratio to ib_write_lat (the job's ceiling here);
- `copy jobs <size> x16` at 64 KiB and 1 MiB, 16 jobs in flight (submitted with
  `submit_many`), bytes the agent WROTE per second against `ib_write_bw` with 16 in
  flight (each job also READs as much);
- `4 KiB copy job p50 (busy)` / `(event)`: the same with the agent's other polling
  modes ([dataplane] poll_mode; the default, adaptive, polls for poll_spin = 2 ms after
  the last activity, then sleeps on the completion channel). Under TCG a job takes
  milliseconds, so the agent's idle gap between two jobs often exceeds 2 ms and
  adaptive behaves as event mode; busy shows what polling through that gap gives;
- a table: where the 4 KiB copy job's time goes, hop by hop in both processes
  (`bench.hops`, a separate agent with timers, so its total is a little above the p50),
  and the CPU each thread of either process used.
"""

from __future__ import annotations

import host_client
from bench import common, perftest
from bench.common import TAIL, Result, Table, agent_process, quantile, quick
from dpu_wire.transport import native

NAME = "verbs_jobs"
LAT_JOBS = quick(2000, 200)
FLOOR_JOBS = quick(2000, 200)
HOP_JOBS = quick(1000, 100)
BW_SECONDS = quick(4.0, 0.5)
BW_BYTES = quick(128 << 20, 16 << 20)  # ib_write_bw's count: a few seconds' worth
SIZES = (64 << 10, 1 << 20)
IN_FLIGHT = 16
MIB = float(1 << 20)


async def job_latency_us(target: str, *, inline: bool = True) -> list[float]:
    """Sorted submit-to-completion times of 4 KiB copy jobs, one in flight."""
    async with (
        host_client.Client(target, timeout=60) as client,
        await client.open_session(transport="verbs", queue_depth=4, inline=inline) as session,
    ):
        src = await session.alloc(4096, readable=True)
        dst = await session.alloc(4096, writable=True)
        return await common.job_latencies_us(session, session.copy_request(src, dst), LAT_JOBS)


async def job_throughput_mib_s(target: str, size: int) -> float:
    """MiB/s the agent writes with IN_FLIGHT copy jobs of `size` bytes."""
    async with (
        host_client.Client(target, timeout=60) as client,
        await client.open_session(transport="verbs", queue_depth=IN_FLIGHT) as session,
    ):
        src = await session.alloc(size, readable=True)
        requests = [
            session.copy_request(src, await session.alloc(size, writable=True))
            for _ in range(IN_FLIGHT)
        ]
        await common.run_jobs(session, requests, 0.2)  # warm-up
        done, elapsed = await common.run_jobs(session, requests, BW_SECONDS)
        return done * size / elapsed / MIB


def measure() -> tuple[list[Result], list[Table]]:
    """Interleave each reference with ours on the same port."""
    port, client = common.find_port(), common.host_port()
    env = {"DPU_AGENT_TRANSPORTS": "verbs", "DPU_AGENT_RDMA_DEVICE": port[0]}
    results = []
    with agent_process(env) as target:
        typical, p99 = perftest.write_lat(port, client=client)
        samples = common.arun(job_latency_us(target))
        p50_ours, p99_ours = quantile(samples, 0.5), quantile(samples, 0.99)
        print(f"4 KiB copy job: p50 {p50_ours:.0f} us, p99 {p99_ours:.0f} us")
        results += [
            Result("4 KiB copy job p50", p50_ours, typical, "us", "ib_write_lat typ", False),
            Result(
                "4 KiB copy job p99", p99_ours, p99, "us", "ib_write_lat p99", False, tolerance=TAIL
            ),
        ]
        read_path = quantile(common.arun(job_latency_us(target, inline=False)), 0.5)
        print(f"4 KiB copy job, READ path: p50 {read_path:.0f} us")
        results.append(
            Result(
                "4 KiB copy job p50, READ path",
                read_path,
                typical,
                "us",
                "ib_write_lat typ",
                False,
                note="open_session(inline=False): the agent READs the source",
            )
        )
        floor = common.run_module(
            "bench.pyverbs_floor", "--jobs", str(FLOOR_JOBS), env={native.ENV: "0"}
        )
        core = common.run_module(
            "bench.pyverbs_floor", "--jobs", str(FLOOR_JOBS), "--shape", "inline"
        )
        print(f"pyverbs floor: p50 {floor['p50_us']:.0f} us, p99 {floor['p99_us']:.0f} us")
        print(f"inline shape, bare loop: p50 {core['p50_us']:.0f} us (core {core['native']})")
        results += [
            Result(
                "4 KiB copy job p50, vs the pyverbs floor",
                p50_ours,
                floor["p50_us"],
                "us",
                "the job on pyverbs alone (bench.pyverbs_floor, DPU_NATIVE=0) p50",
                False,
            ),
            Result(
                "pyverbs floor copy job p50",
                floor["p50_us"],
                typical,
                "us",
                "ib_write_lat typ",
                False,
                note="the READ path written on pyverbs alone: the ceiling for pure Python here",
            ),
            Result(
                "4 KiB copy job p50, vs its shape in a bare loop",
                p50_ours,
                core["p50_us"],
                "us",
                "the inline job's posts in a bare busy loop (pyverbs_floor --shape inline) p50",
                False,
                note="native core: "
                + ("yes" if core["native"] else "no (not built or DPU_NATIVE=0)"),
            ),
            Result(
                "bare loop inline copy job p50",
                core["p50_us"],
                typical,
                "us",
                "ib_write_lat typ",
                False,
                note="the default job's wire shape with no framework: its ceiling on this device",
            ),
        ]
        for size in SIZES:
            reference = perftest.write_bw(port, size, IN_FLIGHT, BW_BYTES, client=client)
            ours = common.arun(job_throughput_mib_s(target, size))
            label = common.size_label(size)
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
    for mode in ("busy", "event"):
        with agent_process({**env, "DPU_AGENT_POLL_MODE": mode}) as target:
            samples = common.arun(job_latency_us(target))
        p50 = quantile(samples, 0.5)
        print(f"4 KiB copy job, agent polling {mode}: p50 {p50:.0f} us")
        results.append(
            Result(f"4 KiB copy job p50 ({mode})", p50, typical, "us", "ib_write_lat typ", False)
        )
    return results, common.hops_tables("verbs", HOP_JOBS)


def main() -> list[Result]:
    """Measure here when there is an RDMA device, else in the soft-RoCE test VM."""
    return common.run_rdma_bench(NAME, measure)


if __name__ == "__main__":
    common.command_line(__doc__)
    main()

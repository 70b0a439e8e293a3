"""RDMA WRITE through VerbsAgentTransport vs perftest, on the same rxe port in the same run.

Needs an RDMA device, so it runs in the soft-RoCE test VM:

    python3 deploy/testvm/testvm.py run -- .venv/bin/python -m bench.verbs_write

Started on a machine without RDMA (`python -m bench.verbs_write`, `make bench`), it runs
itself in the VM that way. The VM's checkout is read-only, so the guest writes the
results under .testvm/out/ and the host side copies them to bench/results/.

Measured, with host and agent transports in one process on one device:

1. bandwidth: `ib_write_bw -F -t IN_FLIGHT -n ...` (its own loopback client and server,
   both on the device) against our `write()` with IN_FLIGHT concurrent writes, the same
   BW_BYTES each, at 64 KiB and 1 MiB. (perftest's duration mode, -D, under-reports
   here: 10 MiB/s at 1 MiB with its default 128 in flight, 48 with -n);
2. latency: `ib_write_lat -s 4096` (typical and p99) against our 4 KiB `write()` with
   one in flight (p50 and p99). ib_write_lat reports half a ping-pong round trip;
   ours is post to completion, which includes the responder's ACK: a full round trip;
3. where our 4 KiB write spends its time (printed): the Python before the post, the
   post itself (pyverbs and the provider's doorbell), the wait for the work completion,
   and the resume of the awaiting task; next to a raw pyverbs loop (post, busy-poll the
   CQ, no asyncio) on the same QP, the floor for any Python caller.

Both poll modes are measured.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import common
from bench.common import TAIL, Result
from dpu_wire.transport.base import Access
from dpu_wire.transport.verbs import (
    VerbsAgentTransport,
    VerbsHostTransport,
    VerbsRegion,
    find_port,
)

if TYPE_CHECKING:
    from collections.abc import Callable

NAME = "verbs_write"
SIZES = (64 << 10, 1 << 20)
IN_FLIGHT = 16
BW_BYTES = 128 << 20  # per bandwidth measurement: ~3 s at the ~45 MiB/s of rxe under TCG
LAT_SIZE = 4096
LAT_OPS = 2000
POLL_MODES = ("event", "busy")
PERFTEST_PORT_WAIT_S = 30.0
CHECKOUT = Path(__file__).resolve().parent.parent
MIB = float(1 << 20)


# ---------------------------------------------------------------- perftest


def _perftest(tool: str, args: list[str]) -> list[str]:
    """Run a perftest server and its loopback client; the client's result line."""
    server = subprocess.Popen(
        [tool, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + PERFTEST_PORT_WAIT_S
        while True:  # the client fails until the server listens
            client = subprocess.run(
                [tool, *args, "127.0.0.1"], capture_output=True, text=True, check=False
            )
            if client.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        server.wait(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    if client.returncode != 0:
        raise RuntimeError(f"{tool} failed: {client.stdout}{client.stderr}")
    size = args[args.index("-s") + 1]
    for line in client.stdout.splitlines():
        fields = line.split()
        if fields and fields[0] == size:
            return fields
    raise RuntimeError(f"no result line for size {size} in:\n{client.stdout}")


def perftest_bw(port: tuple[str, int, int], size: int) -> float:
    """ib_write_bw's BW average, MiB/s (perftest's MB are 2**20 bytes)."""
    device, port_num, gid = port
    args = ["-d", device, "-i", str(port_num), "-x", str(gid), "-F", "-s", str(size)]
    fields = _perftest("ib_write_bw", [*args, "-t", str(IN_FLIGHT), "-n", str(BW_BYTES // size)])
    return float(fields[3])  # #bytes #iterations BW-peak BW-average MsgRate


def perftest_lat(port: tuple[str, int, int]) -> tuple[float, float]:
    """ib_write_lat's (typical, p99) in microseconds."""
    device, port_num, gid = port
    args = ["-d", device, "-i", str(port_num), "-x", str(gid), "-F", "-s", str(LAT_SIZE)]
    fields = _perftest("ib_write_lat", [*args, "-n", str(LAT_OPS)])
    return float(fields[4]), float(fields[7])  # bytes iters min max typical avg stdev p99


# ---------------------------------------------------------------- ours


async def _pair(
    port: tuple[str, int, int], poll_mode: str
) -> tuple[VerbsHostTransport, VerbsAgentTransport]:
    device, port_num, gid = port
    host = VerbsHostTransport(device, port_num, gid, queue_depth=IN_FLIGHT, poll_mode=poll_mode)
    agent = VerbsAgentTransport(device, port_num, gid, queue_depth=IN_FLIGHT, poll_mode=poll_mode)
    await agent.connect(host.address)
    await host.connect(agent.address)
    return host, agent


async def _write_for(agent: VerbsAgentTransport, dst: VerbsRegion, size: int, ops: int) -> float:
    """Seconds to WRITE `ops` times `size` bytes with IN_FLIGHT writes in flight."""
    staging = agent.staging(size * IN_FLIGHT)
    staging.view[:] = os.urandom(len(staging.view))
    remaining = ops

    async def worker(slot: int) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            offset = slot * size
            await agent.write(staging, offset, size, dst.addr + offset, dst.rkey)

    start = time.perf_counter()
    await asyncio.gather(*(worker(slot) for slot in range(IN_FLIGHT)))
    elapsed = time.perf_counter() - start
    agent.release(staging)
    return elapsed


async def ours_bw(port: tuple[str, int, int], size: int, poll_mode: str) -> tuple[float, float]:
    """(MiB/s, CPU seconds of this process per wall second) for IN_FLIGHT writes of `size`."""
    host, agent = await _pair(port, poll_mode)
    try:
        dst = host.register(size * IN_FLIGHT, Access.REMOTE_WRITE)
        await _write_for(agent, dst, size, 2 * IN_FLIGHT)  # warm-up
        ops = BW_BYTES // size
        cpu0 = _cpu_seconds()
        elapsed = await _write_for(agent, dst, size, ops)
        cpu = (_cpu_seconds() - cpu0) / elapsed
    finally:
        await agent.close()
        await host.close()
    return ops * size / elapsed / MIB, cpu


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


class _Phases:
    """Timestamps of one instrumented write: call, post begins/ends, WC seen, resumed."""

    def __init__(self) -> None:
        self.post_begin: list[int] = []
        self.post_end: list[int] = []
        self.completed: list[int] = []

    def install(self, qp: Any) -> None:  # noqa: ANN401 - the transport's private _QueuePair
        """Wrap the QP's post and completion handlers to take the timestamps."""
        qp._post_wr = self._timed(self.post_begin, self.post_end, qp._post_wr)  # noqa: SLF001
        qp._complete = self._timed(self.completed, None, qp._complete)  # noqa: SLF001

    @staticmethod
    def _timed(
        stamps: list[int], after: list[int] | None, fn: Callable[..., None]
    ) -> Callable[..., None]:
        def timed(*args: object) -> None:
            stamps.append(time.perf_counter_ns())
            fn(*args)
            if after is not None:
                after.append(time.perf_counter_ns())

        return timed


async def ours_lat(port: tuple[str, int, int], poll_mode: str) -> dict[str, float]:
    """Our 4 KiB write latency (one in flight), its phases, and the raw pyverbs floor (us)."""
    host, agent = await _pair(port, poll_mode)
    try:
        dst = host.register(LAT_SIZE, Access.REMOTE_WRITE)
        staging = agent.staging(LAT_SIZE)
        for _ in range(50):  # warm-up
            await agent.write(staging, 0, LAT_SIZE, dst.addr, dst.rkey)
        phases = _Phases()
        phases.install(agent._qp)  # noqa: SLF001 - instrumentation of what is measured
        calls, done = [], []
        for _ in range(LAT_OPS):
            calls.append(time.perf_counter_ns())
            await agent.write(staging, 0, LAT_SIZE, dst.addr, dst.rkey)
            done.append(time.perf_counter_ns())
        result = _latency_report(calls, done, phases)
        result["raw_p50"], result["raw_p99"] = _raw_floor(agent, staging, dst)
        result["build_wr"] = _build_cost(staging)
    finally:
        await agent.close()
        await host.close()
    return result


def _latency_report(calls: list[int], done: list[int], phases: _Phases) -> dict[str, float]:
    def p50(values: list[int]) -> float:
        return statistics.median(values) / 1000

    total = [d - c for c, d in zip(calls, done, strict=True)]
    return {
        "p50": p50(total),
        "p99": _p99(total) / 1000,
        "before_post": p50([b - c for c, b in zip(calls, phases.post_begin, strict=True)]),
        "post": p50([e - b for b, e in zip(phases.post_begin, phases.post_end, strict=True)]),
        "wait_wc": p50([w - e for e, w in zip(phases.post_end, phases.completed, strict=True)]),
        "resume": p50([d - w for w, d in zip(phases.completed, done, strict=True)]),
    }


def _raw_floor(
    agent: VerbsAgentTransport, staging: VerbsRegion, dst: VerbsRegion
) -> tuple[float, float]:
    """p50/p99 us of post + busy-poll the CQ from plain Python on the same QP (no asyncio)."""
    import pyverbs.enums as ev  # noqa: PLC0415 - present: the transport is running

    qp = agent._qp  # noqa: SLF001 - the transport's own post path, without asyncio
    cq = qp._cq  # noqa: SLF001
    samples = []
    local = (staging.addr, LAT_SIZE, staging.lkey)
    for i in range(LAT_OPS):
        start = time.perf_counter_ns()
        qp._post_wr(1 << 40 | i, ev.IBV_WR_RDMA_WRITE, local, (dst.addr, dst.rkey))  # noqa: SLF001
        while True:
            count, wcs = cq.poll(1)
            if count:
                break
        samples.append(time.perf_counter_ns() - start)
        if wcs[0].status != ev.IBV_WC_SUCCESS:
            raise RuntimeError(f"raw write failed: {wcs[0].status}")
    return statistics.median(samples) / 1000, _p99(samples) / 1000


def _build_cost(staging: VerbsRegion) -> float:
    """p50 us to build and free the SGE and SendWR of one post, without posting it."""
    import pyverbs.enums as ev  # noqa: PLC0415 - present: the transport is running
    from pyverbs.wr import SGE, SendWR  # noqa: PLC0415

    samples = []
    for i in range(LAT_OPS):
        start = time.perf_counter_ns()
        sge = SGE(staging.addr, LAT_SIZE, staging.lkey)
        wr = SendWR(
            wr_id=i,
            opcode=ev.IBV_WR_RDMA_WRITE,
            num_sge=1,
            sg=[sge],
            send_flags=ev.IBV_SEND_SIGNALED,
        )
        sge.close()
        wr.set_wr_rdma(0, 0)
        wr.close()
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples) / 1000


def _p99(values: list[int]) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))])


# ---------------------------------------------------------------- the run


def measure() -> list[Result]:
    """Every figure, interleaved so that reference and ours see the same machine."""
    port = find_port(os.environ.get("DPU_TEST_RDMA_DEVICE"))
    print(f"device {port[0]} port {port[1]} gid index {port[2]}; {IN_FLIGHT} writes in flight")
    results = []
    for size in SIZES:
        reference = perftest_bw(port, size)
        for mode in POLL_MODES:
            ours, cpu = asyncio.run(ours_bw(port, size, mode))
            print(f"  write {size >> 10} KiB, {mode}: {ours:.1f} MiB/s, process CPU {cpu:.2f}")
            results.append(
                Result(
                    f"RDMA WRITE {size >> 10} KiB x{IN_FLIGHT} ({mode})",
                    ours,
                    reference,
                    "MiB/s",
                    "ib_write_bw",
                    size=size,
                    series=f"RDMA WRITE x{IN_FLIGHT} ({mode})",
                )
            )
    typical, p99 = perftest_lat(port)
    for mode in POLL_MODES:
        lat = asyncio.run(ours_lat(port, mode))
        print(
            f"  4 KiB write, {mode}: p50 {lat['p50']:.0f} us = before post "
            f"{lat['before_post']:.0f} + post {lat['post']:.0f} + wait for WC "
            f"{lat['wait_wc']:.0f} + resume {lat['resume']:.0f} (the post: building the "
            f"SGE and SendWR {lat['build_wr']:.0f}, the rest ibv_post_send); raw pyverbs "
            f"post+poll p50 {lat['raw_p50']:.0f} us, p99 {lat['raw_p99']:.0f} us"
        )
        results += [
            Result(
                f"4 KiB write p50 ({mode})", lat["p50"], typical, "us", "ib_write_lat typ", False
            ),
            Result(
                f"4 KiB write p99 ({mode})",
                lat["p99"],
                p99,
                "us",
                "ib_write_lat p99",
                False,
                tolerance=TAIL,
            ),
            Result(
                f"4 KiB write p50 ({mode}) vs raw pyverbs",
                lat["p50"],
                lat["raw_p50"],
                "us",
                "pyverbs post+poll",
                False,
            ),
        ]
    return results


def main() -> list[Result]:
    """Measure here when there is an RDMA device, else in the soft-RoCE test VM."""
    return common.run_rdma_bench(NAME, measure)


if __name__ == "__main__":
    main()

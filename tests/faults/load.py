"""The load scenario (tcp on the host, verbs in the VM): many clients, every byte checked.

`PROCESSES` host processes (`load_client`) each run `clients` asyncio clients with a
session of their own, against one agent process. A warm-up round runs enough jobs
per session to fill its retained-jobs window (the agent keeps the last
`SessionSettings.retained` finished jobs of a session; a shorter full round gets a
warm-up of its own length), so the agent's memory has seen its working set; then the
full round runs. The agent's resident memory
(VmRSS) after each round is compared: growth beyond `RSS_GROWTH_LIMIT` is a leak.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import host_client
from dpu_agent.dataplane.session import SessionSettings
from tests.faults import load_client
from tests.faults.common import MiB, rss_bytes, session_names

REPO = Path(__file__).resolve().parents[2]
RSS_GROWTH_LIMIT = 32 * MiB
WARM_UP_JOBS = SessionSettings.retained + 176  # per client: past the retained window


def warm_up_jobs(jobs: int) -> int:
    """Jobs per client in the warm-up: as many as the full round keeps retained, or more."""
    return jobs if jobs <= SessionSettings.retained else WARM_UP_JOBS


@dataclasses.dataclass
class Round:
    """One round: its totals over every process, how long it took, the agent's RSS after."""

    totals: dict[str, int]
    seconds: float
    rss_after: int
    latencies_us: list[int]  # every job's, sorted

    def percentile(self, q: float) -> int:
        """The q-quantile of the jobs' latencies, in microseconds."""
        return self.latencies_us[min(len(self.latencies_us) - 1, int(q * len(self.latencies_us)))]


async def _process(args: list[str]) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        load_client.__name__,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=REPO,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, f"a load process failed:\n{err.decode()[-4000:]}"
    report: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return report


async def run_round(
    agent_address: str,
    agent_pid: int,
    transport: str,
    processes: int,
    clients: int,
    jobs: int,
    device: str | None = None,
) -> Round:
    """Run `processes` x `clients` clients of `jobs` jobs each; check and sum their totals."""
    started = time.monotonic()
    reports = await asyncio.gather(
        *(
            _process([agent_address, transport, str(clients), str(jobs), str(seed)])
            if device is None
            else _process([agent_address, transport, str(clients), str(jobs), str(seed), device])
            for seed in range(processes)
        )
    )
    seconds = time.monotonic() - started
    totals: dict[str, int] = {}
    latencies: list[int] = []
    for report in reports:
        latencies += report.pop("latencies_us")
        for key, value in report.items():
            if key != "seconds":
                totals[key] = totals.get(key, 0) + value
    async with host_client.Client(agent_address) as client:  # every session closed
        assert await session_names(client) == set(), "sessions left over after the round"
    return Round(totals, seconds, rss_bytes(agent_pid), sorted(latencies))


def check(totals: dict[str, int], expected_jobs: int) -> None:
    """Every job completed once, was seen once on the watch stream, and checked."""
    assert totals["jobs"] == expected_jobs, totals
    assert totals["duplicate_completions"] == 0, totals
    assert totals["lost_on_watch"] == 0, totals
    assert totals["duplicate_on_watch"] == 0, totals
    assert totals["unknown_on_watch"] == 0, totals
    assert totals["copies"] + totals["crcs"] + 2 * totals["volume_writes"] == expected_jobs
    assert totals["volume_writes"] == totals["volume_reads"] > 0, totals
    assert totals["rpc_jobs"] > 0, totals


async def run(
    agent_address: str,
    agent_pid: int,
    transport: str,
    processes: int,
    clients: int,
    jobs: int,
    device: str | None = None,
) -> tuple[Round, Round]:
    """The warm-up round, then the full round; check both; print the numbers."""
    rss_start = rss_bytes(agent_pid)
    warm_jobs = warm_up_jobs(jobs)
    warm = await run_round(
        agent_address, agent_pid, transport, processes, clients, warm_jobs, device
    )
    check(warm.totals, processes * clients * warm_jobs)
    full = await run_round(agent_address, agent_pid, transport, processes, clients, jobs, device)
    check(full.totals, processes * clients * jobs)
    growth = full.rss_after - warm.rss_after
    print(  # noqa: T201 - the numbers the report quotes
        f"\n{transport}: {processes} processes x {clients} clients; agent RSS "
        f"{rss_start / MiB:.1f} MiB at start, {warm.rss_after / MiB:.1f} MiB after the warm-up "
        f"({warm.totals['jobs']} jobs, {warm.seconds:.1f} s), {full.rss_after / MiB:.1f} MiB "
        f"after the full round ({full.totals['jobs']} jobs, {full.seconds:.1f} s): growth "
        f"{growth / MiB:.1f} MiB\nfull round: {full.totals}\njob latency, submit to checked "
        f"completion: p50 {full.percentile(0.5)} us, p99 {full.percentile(0.99)} us, max "
        f"{full.latencies_us[-1]} us"
    )
    assert growth < RSS_GROWTH_LIMIT, (
        f"the agent's RSS grew {growth / MiB:.1f} MiB over the full round (a leak?)"
    )
    return warm, full

"""Compute jobs at 1 MiB through the agent, vs the lower of their two limits, same run.

Ours: an agent process and the SDK over the tcp data plane, 8 jobs in flight
(submitted in batches with `submit_many`), each READing 1 MiB of host memory,
transforming it on the agent's compute workers, WRITing the output back. MiB/s of input.

A job is bound by the slower of its compute and its transport, so the reference is the
lower of two limits, both measured in the same run:

- the library the agent uses, called directly in a loop in one thread on the same
  1 MiB (zstandard level 3; AES-256-GCM from cryptography);
- the tcp transport alone moving the job's bytes (bench.linkbench: a `TcpHostLink` in
  its own process, a `TcpAgentLink` on a reactor thread): per job a 1 MiB READ and a
  WRITE of the output's size, 8 jobs in flight.

The figure's note gives both limits. crc32c at 1 MiB is measured in bench.tcp_dataplane
(`crc32c jobs 1024 KiB x8, tcp`) against a raw TCP stream.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import zstandard
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

import host_client
from bench import common
from bench.common import Result, agent_process, quick, write_results
from bench.linkbench import LinkPair

if TYPE_CHECKING:
    from collections.abc import Callable

SIZE = 1 << 20
SECONDS = quick(2.0, 0.3)
IN_FLIGHT = 8
DATA = (os.urandom(SIZE // 2) + b"compute job benchmark text " * (SIZE // 27 + 1))[:SIZE]
KEY = os.urandom(32)
NONCE = os.urandom(12)
MIB = float(1 << 20)
ZSTD_LEVEL = 3  # dpu_agent.dataplane.compute.ZSTD_LEVEL
GCM_OVERHEAD = 12 + 16  # nonce and tag around the ciphertext


class Kind:
    """One compute kind: its figure name, the SDK's parameters, the library call."""

    def __init__(
        self, name: str, sdk_kind: str, work: Callable[[bytes], bytes], out_size: int
    ) -> None:
        self.name = name
        self.sdk_kind = sdk_kind
        self.work = work
        self.out_size = out_size  # bytes the job WRITEs back for DATA


def kinds() -> list[Kind]:
    """The kinds measured, with their output sizes for DATA."""
    compress = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    gcm = AESGCM(KEY)
    return [
        Kind(
            "zstd compress",
            "compress",
            compress.compress,
            len(compress.compress(DATA)),
        ),
        Kind("AES-GCM", "encrypt", lambda d: gcm.encrypt(NONCE, d, None), SIZE + GCM_OVERHEAD),
    ]


def direct_mib_s(work: Callable[[bytes], object]) -> float:
    """MiB/s of `work` on DATA in a loop."""
    done = 0
    start = time.perf_counter()
    while time.perf_counter() - start < SECONDS:
        work(DATA)
        done += SIZE
    return done / (time.perf_counter() - start) / MIB


def transport_mib_s(pair: LinkPair, out_size: int) -> float:
    """MiB/s of input the tcp transport moves alone: a 1 MiB READ + an output WRITE per job."""
    steps = [("read", SIZE), ("write", out_size)]
    pair.run(steps, IN_FLIGHT, 2 * IN_FLIGHT)  # warm-up
    jobs = max(2 * IN_FLIGHT, int(SECONDS * 300))  # about SECONDS at 300 MiB/s
    run = pair.run(steps, IN_FLIGHT, jobs)
    return jobs * SIZE / run.elapsed_s / MIB


async def through_agent(target: str, kind: Kind) -> float:
    """MiB/s of input processed by `kind` jobs through the agent."""
    async with (
        host_client.Client(target) as client,
        await client.open_session(transport="tcp", queue_depth=IN_FLIGHT) as session,
    ):
        src = await session.alloc(SIZE, readable=True)
        src.view[:] = DATA
        parameter: int | str = "zstd"
        if kind.sdk_kind == "encrypt":
            parameter = await session.register_key(KEY)
        requests = [
            session.compute_request(
                kind.sdk_kind,
                src,
                await session.alloc(2 * SIZE, writable=True),
                parameter=parameter,
            )
            for _ in range(IN_FLIGHT)
        ]
        await common.run_jobs(session, requests, 0.2)  # warm-up
        done, elapsed = await common.run_jobs(session, requests, SECONDS)
        return done * SIZE / elapsed / MIB


def main() -> list[Result]:
    """Run and write bench/results/compute_jobs.json."""
    results = []
    with agent_process() as target, LinkPair("tcp", IN_FLIGHT, 2 * SIZE) as pair:
        for kind in kinds():
            library = direct_mib_s(kind.work)
            transport = transport_mib_s(pair, kind.out_size)
            ours = common.arun(through_agent(target, kind))
            reference = min(library, transport)
            which = "library called directly" if library <= transport else "tcp transport alone"
            print(
                f"{kind.name}: ours {ours:.0f} MiB/s; library {library:.0f}, "
                f"transport moving the bytes {transport:.0f}"
            )
            results.append(
                Result(
                    f"{kind.name} jobs 1 MiB x{IN_FLIGHT}, tcp",
                    ours,
                    reference,
                    "MiB/s",
                    f"the lower limit: {which}",
                    note=(
                        f"library called directly {library:,.0f} MiB/s, the tcp transport "
                        f"moving the job's bytes (1 MiB READ + {kind.out_size:,} B WRITE) "
                        f"{transport:,.0f} MiB/s"
                    ),
                )
            )
    write_results("compute_jobs", results)
    return results


if __name__ == "__main__":
    common.command_line(__doc__)
    main()

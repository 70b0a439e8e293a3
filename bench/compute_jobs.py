"""Compute jobs at 1 MiB through the agent vs the same library called directly, same run.

Ours: an agent process and the SDK over the tcp data plane, 8 jobs in flight, each
READing 1 MiB of host memory, computing on the DPU side, WRITing the output back.
Reference: the library the agent uses (crc32c, zstandard level 3, AES-256-GCM from
cryptography) called in a loop in this process on the same 1 MiB.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING

import crc32c
import zstandard
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

import host_client
from bench.common import Result, agent_process, write_results

if TYPE_CHECKING:
    from collections.abc import Callable

SIZE = 1 << 20
SECONDS = 2.0
IN_FLIGHT = 8
DATA = (os.urandom(SIZE // 2) + b"compute job benchmark text " * (SIZE // 27 + 1))[:SIZE]
KEY = os.urandom(32)


def direct(work: Callable[[bytes], object]) -> float:
    """MiB/s of `work` on DATA in a loop."""
    done = 0
    start = time.perf_counter()
    while time.perf_counter() - start < SECONDS:
        work(DATA)
        done += SIZE
    return done / (time.perf_counter() - start) / SIZE


async def through_agent(target: str, kind: str) -> float:
    """MiB/s of input processed by `kind` jobs through the agent."""
    async with (
        host_client.Client(target) as client,
        await client.open_session(transport="tcp", queue_depth=IN_FLIGHT) as session,
    ):
        src = await session.alloc(SIZE, readable=True)
        src.view[:] = DATA
        parameter: int | str = 0
        if kind == "compress":
            parameter = "zstd"
        elif kind == "encrypt":
            parameter = await session.register_key(KEY)
        outputs = [await session.alloc(2 * SIZE, writable=True) for _ in range(IN_FLIGHT)]
        done = 0
        start = time.perf_counter()

        async def worker(out: host_client.Buffer) -> None:
            nonlocal done
            while time.perf_counter() - start < SECONDS:
                if kind == "crc32c":
                    await session.crc32c(src)
                else:
                    await session.compute(kind, src, out, parameter=parameter)
                done += SIZE

        await asyncio.gather(*(worker(o) for o in outputs))
        return done / (time.perf_counter() - start) / SIZE


def main() -> list[Result]:
    """Run and write bench/results/compute_jobs.json."""
    nonce = os.urandom(12)
    references: dict[str, Callable[[bytes], object]] = {
        "crc32c": crc32c.crc32c,
        "compress": lambda d: zstandard.ZstdCompressor(level=3).compress(d),
        "encrypt": lambda d: AESGCM(KEY).encrypt(nonce, d, None),
    }
    names = {"crc32c": "crc32c", "compress": "zstd compress", "encrypt": "AES-256-GCM encrypt"}
    results = []
    with agent_process() as target:
        for kind, work in references.items():
            reference = direct(work)
            ours = asyncio.run(through_agent(target, kind))
            results.append(
                Result(
                    f"{names[kind]} jobs 1 MiB x{IN_FLIGHT}",
                    ours,
                    reference,
                    "MiB/s",
                    f"{names[kind]} called directly",
                )
            )
    write_results("compute_jobs", results)
    return results


if __name__ == "__main__":
    main()

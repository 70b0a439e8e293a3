"""After the fuzz run: the agent is up, SERVING, answers a normal RPC, logged no error.

This module runs last (pytest takes the files of a directory in name order).
"""

from __future__ import annotations

import os

import crc32c
import pytest

from tests.fuzz.conftest import all_targets, check_alive, internal_errors, serving
from tests.fuzz.stats import MIN_CASES, STATS


def test_agent_still_serves_after_the_fuzz_run(fuzz_loop, fuzz_agent, channel, client):
    check_alive(fuzz_agent)
    assert fuzz_loop.run(serving(channel)) == "SERVING"
    info = fuzz_loop.run(client.agent_info())
    assert info.name

    async def normal_work() -> tuple[bytes, bytes, int]:
        await client.create_volume("fz-final", 1 << 20, crc32c=True, compression="lz4")
        async with await client.open_session(transport="tcp") as session:
            src = await session.alloc(8192, readable=True)
            dst = await session.alloc(8192, readable=True, writable=True)
            src.view[:] = os.urandom(8192)
            await session.copy(src, dst)
            copied = bytes(dst.view)
            await session.write_volume("volumes/fz-final", 0, src)
            dst.view[:] = bytes(8192)
            await session.read_volume("volumes/fz-final", 0, dst)
            crc = await session.crc32c(dst)
            return bytes(src.view), copied + bytes(dst.view), crc

    data, back, crc = fuzz_loop.run(normal_work())
    assert back == data * 2
    assert crc == crc32c.crc32c(data)


def test_the_agent_logged_no_internal_error(fuzz_agent):
    assert internal_errors(fuzz_agent) == []


def test_the_run_reached_its_case_floor():
    missing = STATS.missing(all_targets())
    if missing:
        pytest.skip(
            f"{len(missing)} fuzz targets were not selected (e.g. {min(missing)}); the "
            f"floor of {MIN_CASES} cases applies to a run of the whole suite, and each "
            "fuzz test checked its own count"
        )
    assert STATS.total >= MIN_CASES, STATS.cases

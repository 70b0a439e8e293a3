"""The agent killed in the middle of jobs, shared by the tcp and verbs suites.

Every pending job fails with UnavailableError, the session says it failed and takes
no more jobs, and a new session on a restarted agent works.
"""

from __future__ import annotations

import asyncio
import signal
from typing import TYPE_CHECKING

import crc32c
import pytest

import host_client
from tests.integration.conftest import start_agent

if TYPE_CHECKING:
    from pathlib import Path


async def _completion(job: host_client.Job) -> host_client.Completion:
    return await job


async def pending_jobs_fail_and_a_new_session_works(
    tmp_path: Path, transport: str, env: dict[str, str]
) -> None:
    """Kill the agent with 8 slow copies in flight; then restart it and run a job."""
    env = {**env, "DPU_AGENT_CHUNK_SIZE": "4096"}  # slow jobs: still running at the kill
    agent = start_agent(tmp_path, env=env)
    async with host_client.Client(agent.address, timeout=30) as client:
        session = await client.open_session(transport=transport, queue_depth=8)
        src = await session.alloc(1 << 20, readable=True)
        dst = await session.alloc(1 << 20, writable=True)
        jobs = [await session.submit_copy(src, dst) for _ in range(8)]
        agent.proc.send_signal(signal.SIGKILL)
        agent.proc.wait(30)
        pending = asyncio.gather(*(_completion(j) for j in jobs), return_exceptions=True)
        results = await asyncio.wait_for(pending, 60)
        assert all(isinstance(r, host_client.UnavailableError) for r in results), results
        assert session.failed
        with pytest.raises(host_client.UnavailableError):
            await session.submit_copy(src, dst)
        await session.close()
    restarted = start_agent(tmp_path, env=env)
    try:
        async with (
            host_client.Client(restarted.address, timeout=30) as client,
            await client.open_session(transport=transport) as session,
        ):
            src = await session.alloc(4096, readable=True)
            src.view[:] = b"y" * 4096
            assert await session.crc32c(src) == crc32c.crc32c(b"y" * 4096)
    finally:
        assert restarted.terminate() == 0

"""Either side dying: the survivor notices, fails what was pending, and recovers."""

import asyncio
import signal
import subprocess
import sys
import textwrap

import crc32c
import pytest

import host_client
from dpu_wire.v1 import session_pb2
from tests.integration.conftest import start_agent

pytestmark = pytest.mark.asyncio


async def list_sessions(client):
    reply = await client._call(
        client.stubs.sessions.ListSessions, session_pb2.ListSessionsRequest()
    )
    return list(reply.sessions)


async def test_agent_killed_fails_pending_jobs_and_the_sdk_reconnects(tmp_path):
    agent = start_agent(tmp_path, env={"DPU_AGENT_CHUNK_SIZE": "4096"})
    client = host_client.Client(agent.address, timeout=10)
    async with client:
        session = await client.open_session(transport="tcp", queue_depth=8)
        src = await session.alloc(4 << 20, readable=True)
        dst = await session.alloc(4 << 20, writable=True)
        jobs = [await session.submit_copy(src, dst) for _ in range(8)]
        agent.proc.send_signal(signal.SIGKILL)
        agent.proc.wait(10)
        results = await asyncio.wait_for(
            asyncio.gather(
                *(asyncio.ensure_future(_await(j)) for j in jobs), return_exceptions=True
            ),
            30,
        )
        assert all(isinstance(r, host_client.UnavailableError) for r in results), results
        assert session.failed
        with pytest.raises(host_client.UnavailableError):
            await session.submit_copy(src, dst)
        await session.close()

    restarted = start_agent(tmp_path)
    try:
        async with (
            host_client.Client(restarted.address) as client,
            await client.open_session(transport="tcp") as session,
        ):
            src = await session.alloc(4096, readable=True)
            src.view[:] = b"x" * 4096
            assert await session.crc32c(src) == crc32c.crc32c(b"x" * 4096)
    finally:
        assert restarted.terminate() == 0


async def _await(job):
    return await job


CLIENT = textwrap.dedent(
    """
    import asyncio, sys
    import host_client

    async def main():
        async with host_client.Client(sys.argv[1]) as client:
            session = await client.open_session(transport="tcp")
            await session.alloc(1 << 20, readable=True)
            print(session.name, flush=True)
            await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


async def test_host_killed_the_agent_frees_its_session(tmp_path):
    agent = start_agent(tmp_path, env={"DPU_AGENT_ORPHAN_TIMEOUT": "1"})
    try:
        host = subprocess.Popen(  # noqa: ASYNC220 - starting it is quick
            [sys.executable, "-c", CLIENT, agent.address], stdout=subprocess.PIPE, text=True
        )
        assert host.stdout is not None
        name = await asyncio.wait_for(asyncio.to_thread(host.stdout.readline), 60)
        async with host_client.Client(agent.address) as client:
            assert [s.name for s in await list_sessions(client)] == [name.strip()]
            host.send_signal(signal.SIGKILL)
            host.wait(10)
            for _ in range(200):
                if not await list_sessions(client):
                    break
                await asyncio.sleep(0.05)
            assert await list_sessions(client) == []
        host.stdout.close()
    finally:
        assert agent.terminate() == 0
    logs = [e.get("msg") for e in agent.log_entries()]
    assert "session failed" in logs or "closing orphaned session" in logs

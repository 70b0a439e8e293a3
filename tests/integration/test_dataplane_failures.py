"""Either side dying: the survivor notices, fails what was pending, and recovers."""

import asyncio
import signal
import subprocess
import sys
import textwrap

import pytest

import host_client
from dpu_wire.v1 import session_pb2
from tests.integration.conftest import start_agent
from tests.scenarios import agent_death

pytestmark = pytest.mark.asyncio


async def list_sessions(client):
    reply = await client._call(
        client.stubs.sessions.ListSessions, session_pb2.ListSessionsRequest()
    )
    return list(reply.sessions)


async def test_agent_killed_fails_pending_jobs_and_the_sdk_reconnects(tmp_path):
    await agent_death.pending_jobs_fail_and_a_new_session_works(tmp_path, "tcp", {})


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
    agent = start_agent(
        tmp_path, env={"DPU_AGENT_ORPHAN_TIMEOUT": "1", "DPU_AGENT_FAILED_RETENTION": "1"}
    )
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


async def test_a_failed_sessions_update_time_is_when_it_failed(tmp_path):
    """Session.times: create_time at OpenSession, update_time at its last change of state."""
    agent = start_agent(tmp_path)
    try:
        host = subprocess.Popen(  # noqa: ASYNC220 - starting it is quick
            [sys.executable, "-c", CLIENT, agent.address], stdout=subprocess.PIPE, text=True
        )
        assert host.stdout is not None
        name = (await asyncio.wait_for(asyncio.to_thread(host.stdout.readline), 60)).strip()
        async with host_client.Client(agent.address) as client:
            active = await client.get_session(name)
            assert active.state == session_pb2.SESSION_STATE_ACTIVE
            created = active.times.create_time.ToNanoseconds()
            assert active.times.update_time.ToNanoseconds() >= created > 0
            host.send_signal(signal.SIGKILL)  # the host's end of the connection closes
            host.wait(10)
            for _ in range(200):
                failed = await client.get_session(name)
                if failed.state == session_pb2.SESSION_STATE_FAILED:
                    break
                await asyncio.sleep(0.05)
            assert failed.state == session_pb2.SESSION_STATE_FAILED
            assert failed.times.create_time.ToNanoseconds() == created
            assert (
                failed.times.update_time.ToNanoseconds() > active.times.update_time.ToNanoseconds()
            )
        host.stdout.close()
    finally:
        assert agent.terminate() == 0

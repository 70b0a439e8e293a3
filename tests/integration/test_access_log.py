"""The agent's access log is bounded per tenant ([log] access_per_s), counting what it drops."""

from __future__ import annotations

import asyncio

import pytest

import host_client
from tests.integration.conftest import start_agent

pytestmark = pytest.mark.asyncio

PER_S = 5
CALLS = 60


async def test_a_client_calling_fast_writes_a_bounded_access_log(tmp_path):
    """Every call wrote a line: a client's pace was the log's growth. With 5 lines a
    second, 60 calls in a burst write a handful; the next line written, a second later,
    says how many were dropped, so the log still accounts for every call."""
    agent = start_agent(tmp_path, env={"DPU_AGENT_LOG_ACCESS_PER_S": str(PER_S)})
    try:
        async with host_client.Client(agent.address) as client:
            loop = asyncio.get_running_loop()
            start = loop.time()
            await asyncio.gather(*(client.agent_info() for _ in range(CALLS)))
            burst_s = loop.time() - start
            await asyncio.sleep(1.5)  # the bucket refills
            await client.agent_info()
    finally:
        assert agent.terminate() == 0
    access = [e for e in agent.log_entries() if e.get("msg") == "rpc"]
    written = len(access) - 1  # the burst's lines, without the last call's
    assert written <= PER_S + burst_s * PER_S + 1, (written, burst_s)
    assert access[-1].get("dropped") == CALLS - written, access[-1]
    assert sum(int(str(e.get("dropped", 0))) for e in access) + len(access) == CALLS + 1

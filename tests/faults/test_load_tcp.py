"""Load over tcp: 16 clients (4 processes x 4 asyncio clients) x 2,000 jobs, one agent."""

import pytest

from tests.faults import load
from tests.integration.conftest import start_agent

pytestmark = pytest.mark.asyncio

PROCESSES = 4
CLIENTS = 4  # per process
JOBS = 2000  # per client


async def test_16_clients_x_2000_mixed_jobs_every_byte_checked_and_memory_flat(tmp_path):
    agent = start_agent(tmp_path)
    try:
        _, full = await load.run(agent.address, agent.proc.pid, "tcp", PROCESSES, CLIENTS, JOBS)
        assert full.totals["jobs"] == PROCESSES * CLIENTS * JOBS
    finally:
        assert agent.terminate() == 0, agent.log_path.read_text()

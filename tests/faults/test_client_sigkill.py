"""Fault: the host program SIGKILLed with sessions, regions and queued jobs (tcp)."""

import pytest

from tests.faults import client_death

pytestmark = pytest.mark.asyncio


async def test_the_agent_frees_a_killed_hosts_sessions_regions_and_slots(tmp_path):
    closed = await client_death.agent_frees_a_killed_hosts_sessions(tmp_path, "tcp", {})
    # The idle session learns only from its socket closing: counted as orphaned (the
    # host is gone). A busy one may instead fail on a send first: counted as failed.
    assert closed["orphaned"] >= 1, closed
    assert closed["closed"] == 0, closed

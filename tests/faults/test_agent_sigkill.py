"""Fault: the agent SIGKILLed with volume writes in flight over tcp (see inflight_writes)."""

import pytest

from tests.faults import inflight_writes

pytestmark = pytest.mark.asyncio


async def test_no_acknowledged_write_is_lost_when_the_agent_is_killed(tmp_path):
    ledger = await inflight_writes.acknowledged_writes_survive(tmp_path, "tcp", {})
    assert ledger.acknowledged >= inflight_writes.KILL_AFTER
    assert set(ledger.by_path) == {"capsule-fua", "rpc-fua", "capsule-flush", "rpc-flush"}

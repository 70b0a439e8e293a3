"""The conformance table (tests/conformance/table.py) over verbs on rxe0, in the test VM.

The rows that apply to the verbs transport, against agents that offer verbs only; the
host side is an RC queue pair driven with the suite's own capsule codec
(tests/conformance/rawverbs.py). Over tcp the table runs on the host.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.conformance.harness import Agents, Ctx
from tests.conformance.table import Row, rows_for

pytestmark = [pytest.mark.rdma, pytest.mark.asyncio]

CHECK_TIMEOUT = 180.0  # a hang guard; Python runs several times slower in the VM


@pytest.fixture(scope="module")
def agents(rdma_port, tmp_path_factory):
    """Agent processes offering verbs on the VM's device; each must exit 0 at the end."""
    made = Agents("verbs", tmp_path_factory.mktemp("conformance"), device=rdma_port.device)
    yield made
    assert made.stop() == []


@pytest.mark.parametrize("row", rows_for("verbs"), ids=lambda row: row.rule)
async def test_requirement_over_verbs(row: Row, agents: Agents, host_port) -> None:
    ctx = Ctx("verbs", agents, device=host_port.device)  # the raw host on its own node
    try:
        await asyncio.wait_for(row.check(ctx), CHECK_TIMEOUT)
    finally:
        await ctx.aclose()

"""The conformance table (tests/conformance/table.py) over tcp, against real agents.

Every requirement of docs/data-plane.md that applies to the tcp transport, one test
each, named by its id: `pytest tests/conformance -k DP-2.5` runs section 2.5. The same
table runs over verbs in the soft-RoCE VM (tests/vm/test_conformance_verbs.py).
"""

from __future__ import annotations

import asyncio

import pytest

from tests.conformance.harness import Agents, Ctx
from tests.conformance.table import Row, rows_for

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

CHECK_TIMEOUT = 90.0  # a hang guard; checks take a second or a few


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    """Agent processes offering tcp; each must still run and exit 0 at the end."""
    made = Agents("tcp", tmp_path_factory.mktemp("conformance"))
    yield made
    assert made.stop() == []


@pytest.mark.parametrize("row", rows_for("tcp"), ids=lambda row: row.rule)
async def test_requirement(row: Row, agents: Agents) -> None:
    ctx = Ctx("tcp", agents)
    try:
        await asyncio.wait_for(row.check(ctx), CHECK_TIMEOUT)
    finally:
        await ctx.aclose()

"""Real SIGKILLs of the agent process while hosts overwrite volumes over tcp (agent_kills.py)."""

import pytest

from tests.torture import agent_kills

KILLS = 24


@pytest.mark.asyncio
async def test_overwrites_survive_repeated_sigkills_over_tcp(tmp_path):
    summary = await agent_kills.overwrites_survive_kills(tmp_path, "tcp", {}, KILLS)
    print(f"\n{summary.line()}")  # noqa: T201 - the numbers the report quotes
    assert summary.kills == KILLS
    assert summary.acknowledged >= 4 * KILLS
    assert summary.durable > 0
    assert summary.in_doubt_at_kills > 0, "nothing was in flight at the kills"
    assert summary.snapshots_checked > 0
    assert summary.violations == [], "\n".join(summary.violations[:40])

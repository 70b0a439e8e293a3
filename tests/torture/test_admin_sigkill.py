"""Real SIGKILLs of the agent during admin changes, big writes and racing trims (admin_kills.py)."""

import pytest

from tests.torture import admin_kills

KILLS = 8


@pytest.mark.asyncio
async def test_admin_changes_big_writes_and_trims_survive_sigkills(tmp_path):
    summary = await admin_kills.admin_kills(tmp_path, KILLS)
    print(f"\n{summary.line()}")  # noqa: T201 - the numbers the report quotes
    assert summary.kills == KILLS
    assert summary.admin_ops > KILLS
    assert summary.violations == [], "\n".join(summary.violations[:40])
    # the store directory stays within a few MiB of where it started
    assert max(summary.store_bytes) - summary.store_bytes[0] < 16 << 20, summary.store_bytes

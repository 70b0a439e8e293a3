"""A tenant that floods its data plane with capsules that run no job is slowed down to
its allowance (`[dataplane] refusals_per_s`); every one of them is still answered, and
another tenant's jobs run meanwhile (tests/scenarios/futile_flood.py; over rxe in
tests/vm/test_dataplane_verbs.py). Real agent process, real tcp data planes, two
tenants by bearer token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests.scenarios import futile_flood

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.asyncio


async def test_a_flooding_tenant_is_slowed_to_its_allowance_and_every_capsule_answered(
    tmp_path: Path,
):
    await futile_flood.run(tmp_path, "tcp", {})

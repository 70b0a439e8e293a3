"""The data plane over the tcp transport, agent and client in separate processes."""

import pytest

import host_client
from tests.scenarios import busy_neighbour, mixed_jobs

pytestmark = pytest.mark.asyncio


async def test_1000_mixed_jobs_every_byte_and_crc_checked_exactly_once(agent):
    async with host_client.Client(agent.address) as client:
        report = await mixed_jobs.run(client, transport="tcp", jobs=1000, workers=16)
    assert report.jobs == 1000
    assert report.copies == report.crcs == 500
    assert set(report.completions.values()) == {1}, "a job completed twice"
    assert len(report.completions) == 1000, "a completion was lost"
    assert report.watched == report.completions, "the watch stream lost or repeated a job"


async def test_a_streaming_session_does_not_stall_the_others(tmp_path):
    await busy_neighbour.others_progress_while_a_session_streams(tmp_path, "tcp", {})

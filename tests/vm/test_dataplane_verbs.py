"""The data plane over verbs on rxe0: agent and host client as separate processes."""

from __future__ import annotations

import pytest

import host_client
from tests.integration.conftest import start_agent
from tests.scenarios import mixed_jobs

pytestmark = [pytest.mark.rdma, pytest.mark.asyncio]


@pytest.fixture(scope="module")
def verbs_agent(rdma_port, tmp_path_factory):
    """An agent offering only the verbs transport, on the test's RDMA device."""
    process = start_agent(
        tmp_path_factory.mktemp("agent"),
        env={"DPU_AGENT_TRANSPORTS": "verbs", "DPU_AGENT_RDMA_DEVICE": rdma_port.device},
    )
    yield process
    assert process.terminate() == 0, process.log_path.read_text()


async def test_agent_offers_verbs(verbs_agent, rdma_port):
    async with host_client.Client(verbs_agent.address) as client:
        info = await client.agent_info()
    assert list(info.transports) == [1]  # TRANSPORT_VERBS only
    assert rdma_port.device in [d.name for d in info.rdma_devices]


async def test_1000_mixed_jobs_over_rxe(verbs_agent):
    async with host_client.Client(verbs_agent.address, timeout=60) as client:
        report = await mixed_jobs.run(client, transport="verbs", jobs=1000, workers=16)
    assert report.jobs == 1000
    assert report.copies == report.crcs == 500
    assert set(report.completions.values()) == {1}, "a job completed twice"
    assert len(report.completions) == 1000, "a completion was lost"
    assert report.watched == report.completions, "the watch stream lost or repeated a job"

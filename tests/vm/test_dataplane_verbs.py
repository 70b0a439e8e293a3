"""The data plane over verbs on rxe0: agent and host client as separate processes."""

from __future__ import annotations

import pytest

import host_client
from tests.integration.conftest import start_agent
from tests.scenarios import (
    agent_death,
    bad_capsules,
    busy_neighbour,
    mixed_jobs,
    volume_faults,
    volume_io,
)

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


async def test_bad_capsules_over_rxe(verbs_agent):
    async with host_client.Client(verbs_agent.address, timeout=60) as client:
        await bad_capsules.run(client, "verbs")


async def test_agent_killed_mid_jobs_fails_them_and_a_new_session_works(rdma_port, tmp_path):
    await agent_death.pending_jobs_fail_and_a_new_session_works(
        tmp_path, "verbs", _verbs_env(rdma_port)
    )


async def test_a_streaming_session_does_not_stall_the_others_over_rxe(
    rdma_port, host_port, tmp_path
):
    await busy_neighbour.others_progress_while_a_session_streams(
        tmp_path, "verbs", _verbs_env(rdma_port), host_port.device
    )


async def test_volume_round_trips_over_rxe(verbs_agent):
    async with host_client.Client(verbs_agent.address, timeout=60) as client:
        checked = await volume_io.round_trips(client, "verbs", "rxe")
    assert checked == len(volume_io.COMBINATIONS) * ((2 << 20) + 4096 + 8192)


def _verbs_env(rdma_port):
    return {"DPU_AGENT_TRANSPORTS": "verbs", "DPU_AGENT_RDMA_DEVICE": rdma_port.device}


async def test_corrupted_block_is_detected_over_rxe(rdma_port, tmp_path):
    await volume_faults.corrupted_block_is_detected(tmp_path, "verbs", _verbs_env(rdma_port))


async def test_acknowledged_writes_survive_sigkill_over_rxe(rdma_port, tmp_path):
    await volume_faults.acknowledged_writes_survive_sigkill(
        tmp_path, "verbs", _verbs_env(rdma_port)
    )

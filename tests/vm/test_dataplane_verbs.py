"""The data plane over verbs on rxe0: agent and host client as separate processes."""

from __future__ import annotations

import os

import crc32c
import pytest

import host_client
from tests.integration.conftest import start_agent
from tests.scenarios import (
    agent_death,
    bad_capsules,
    busy_neighbour,
    futile_flood,
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


async def test_a_flooding_tenant_is_slowed_to_its_allowance_over_rxe(rdma_port, tmp_path):
    await futile_flood.run(tmp_path, "verbs", _verbs_env(rdma_port))


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


async def test_small_sources_go_inline_over_rxe(verbs_agent):
    async with (
        host_client.Client(verbs_agent.address, timeout=60) as client,
        await client.open_session(transport="verbs", queue_depth=4) as session,
    ):
        assert session.inline_max == 4096  # the agent's [dataplane] inline_max
        inline: list[bool] = []  # per capsule sent: did it carry its source?
        # the SDK's two ways to the wire: send, and call (Session.run's, verbs' core)
        send, call = session._link.send, session._link.call

        def spy(capsules):
            inline.extend(isinstance(c, tuple) for c in capsules)
            send(capsules)

        def call_spy(capsule, job_id):
            answer = call(capsule, job_id)
            if answer is not False:  # False: not sent (send follows)
                inline.append(isinstance(capsule, tuple))
            return answer

        session._link.send = spy  # type: ignore[method-assign]
        session._link.call = call_spy  # type: ignore[method-assign]
        data = os.urandom(8192)
        buf = await session.alloc(8192, readable=True, writable=True)
        buf.view[:] = data
        out = await session.alloc(8192, writable=True)
        assert await session.crc32c(buf[0:4096]) == crc32c.crc32c(data[:4096])
        await session.copy(buf[0:4096], out[4096:8192])
        assert bytes(out.view[4096:]) == data[:4096]
        await client.create_volume("inline-rxe", 1 << 20)
        await session.write_volume("volumes/inline-rxe", 8192, buf[4096:8192], fua=True)
        await session.read_volume("volumes/inline-rxe", 8192, out[0:4096])
        assert bytes(out.view[:4096]) == data[4096:]
        assert await session.crc32c(buf) == crc32c.crc32c(data)  # 8 KiB: READ
        assert inline == [True, True, True, False, False], inline
    async with (
        host_client.Client(verbs_agent.address, timeout=60) as client,
        await client.open_session(transport="verbs", inline=False) as session,
    ):
        assert session.inline_max == 0
        buf = await session.alloc(512, readable=True)
        buf.view[:] = b"x" * 512
        assert await session.crc32c(buf) == crc32c.crc32c(b"x" * 512)


def _verbs_env(rdma_port):
    return {"DPU_AGENT_TRANSPORTS": "verbs", "DPU_AGENT_RDMA_DEVICE": rdma_port.device}


async def test_corrupted_block_is_detected_over_rxe(rdma_port, tmp_path):
    await volume_faults.corrupted_block_is_detected(tmp_path, "verbs", _verbs_env(rdma_port))


async def test_acknowledged_writes_survive_sigkill_over_rxe(rdma_port, tmp_path):
    await volume_faults.acknowledged_writes_survive_sigkill(
        tmp_path, "verbs", _verbs_env(rdma_port)
    )

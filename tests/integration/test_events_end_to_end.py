"""Agent + real mosquitto + SDK: every job's completion once on MQTT and once on gRPC."""

import asyncio
import collections

import pytest

import host_client
from dpu_wire.v1 import job_pb2
from tests.integration.conftest import start_agent
from tests.integration.mqtt_broker import mosquitto_broker  # noqa: F401 - fixture

pytestmark = pytest.mark.asyncio

JOBS = 200


async def test_each_completion_once_on_mqtt_and_once_on_grpc(mosquitto_broker, tmp_path):  # noqa: F811
    agent = start_agent(
        tmp_path,
        env={
            "DPU_AGENT_MQTT_ENABLED": "true",
            "DPU_AGENT_MQTT_PORT": str(mosquitto_broker.port),
            "DPU_AGENT_ID": "e2e-agent",
        },
    )
    mqtt_seen: collections.Counter[int] = collections.Counter()
    grpc_seen: collections.Counter[int] = collections.Counter()
    try:
        async with (
            host_client.EventSubscriber("127.0.0.1", mosquitto_broker.port) as events,
            host_client.Client(agent.address) as client,
            await client.open_session(transport="tcp") as session,
        ):
            status = await events.agent_status("e2e-agent", wait=10)
            assert status is not None
            assert status.online
            watch = client.stubs.jobs.WatchCompletions(
                job_pb2.WatchCompletionsRequest(session=session.name)
            )
            await watch.wait_for_connection()

            async def read_grpc():
                async for completion in watch:
                    grpc_seen[completion.job_id] += 1

            async with events.completions(session=session.name) as stream:

                async def read_mqtt():
                    async for event in stream:
                        mqtt_seen[event.job_id] += 1

                readers = [asyncio.create_task(read_grpc()), asyncio.create_task(read_mqtt())]
                src = await session.alloc(64 << 10, readable=True)
                jobs = [await session.submit_crc32c(src) for _ in range(JOBS // 2)]
                jobs += [await session.submit_rpc("crc32c", src) for _ in range(JOBS // 2)]
                ids = {job.job_id for job in jobs}
                for job in jobs:
                    assert (await job).ok
                async with asyncio.timeout(30):
                    while set(mqtt_seen) != ids or set(grpc_seen) != ids:  # noqa: ASYNC110
                        await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)  # a duplicate would arrive now
                for reader in readers:
                    reader.cancel()
        assert set(mqtt_seen.values()) == {1}
        assert set(grpc_seen.values()) == {1}
        assert len(mqtt_seen) == len(grpc_seen) == JOBS
    finally:
        assert agent.terminate() == 0

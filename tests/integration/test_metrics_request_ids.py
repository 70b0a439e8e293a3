"""Request ids from the SDK through the agent's logs to the completion events on MQTT.

A real agent process, a real mosquitto and the SDK. Each call's `x-request-id` is the
caller's (a `host_client.request_id` block, or a `request_id=` argument) or a new one
per call; the agent logs it, and a job's completion event carries the id of the
SubmitJob that made it, or for a capsule job the id of its session's OpenSession.
"""

import asyncio
import re

import pytest

import host_client
from tests.integration.conftest import start_agent
from tests.integration.mqtt_broker import mosquitto_broker  # noqa: F401 - fixture

pytestmark = pytest.mark.asyncio

TRACE = "trace-e2e-1"


async def collect(stream, count):
    events = {}
    async with asyncio.timeout(30):
        async for event in stream:
            events[event.job_id] = event
            if len(events) == count:
                return events
    return events


async def test_request_ids_reach_the_logs_and_the_completion_events(mosquitto_broker, tmp_path):  # noqa: F811
    agent = start_agent(
        tmp_path,
        env={
            "DPU_AGENT_MQTT_ENABLED": "true",
            "DPU_AGENT_MQTT_PORT": str(mosquitto_broker.port),
            "DPU_AGENT_ID": "rid-agent",
        },
    )
    try:
        async with (
            host_client.EventSubscriber("127.0.0.1", mosquitto_broker.port) as events,
            host_client.Client(agent.address) as client,
        ):
            with host_client.request_id(TRACE):  # every call in the block carries TRACE
                traced = await client.open_session(transport="tcp")
                src = await traced.alloc(4096, readable=True)
                dst = await traced.alloc(4096, writable=True)
                async with events.completions(session=traced.name) as stream:
                    reader = asyncio.create_task(collect(stream, 3))
                    capsule_job = await traced.submit_copy(src, dst)
                    rpc_job = await traced.submit_rpc("crc32c", src)
                    own_job = await traced.submit_rpc("crc32c", src, request_id="job-rid-7")
                    for job in (capsule_job, rpc_job, own_job):
                        assert (await job).ok
                    traced_events = await reader
                await traced.close()
            assert traced.request_id == TRACE

            named = await client.open_session(transport="tcp", request_id="sess-rid-9")
            assert named.request_id == "sess-rid-9"
            buf = await named.alloc(4096, readable=True)
            async with events.completions(session=named.name) as stream:
                reader = asyncio.create_task(collect(stream, 2))
                capsule_crc = await named.submit_crc32c(buf)
                fresh_rpc = await named.submit_rpc("crc32c", buf)  # a new id of its own
                assert (await capsule_crc).ok
                assert (await fresh_rpc).ok
                named_events = await reader
            await named.close()
    finally:
        assert agent.terminate() == 0

    # completion events: SubmitJob's id, or for capsule jobs the OpenSession's
    assert traced_events[capsule_job.job_id].origin == "capsule"
    assert traced_events[capsule_job.job_id].request_id == TRACE
    assert traced_events[rpc_job.job_id].request_id == TRACE
    assert traced_events[own_job.job_id].request_id == "job-rid-7"
    assert named_events[capsule_crc.job_id].request_id == "sess-rid-9"
    fresh = named_events[fresh_rpc.job_id].request_id
    assert re.fullmatch(r"[0-9a-f]{32}", fresh), fresh

    # the agent's log: every call made in the block carried TRACE ...
    calls = [e for e in agent.log_entries() if e.get("msg") == "rpc"]
    traced_methods = {str(e["method"]).rsplit("/", 1)[1] for e in calls if e["request_id"] == TRACE}
    assert traced_methods == {
        "OpenSession",
        "AdvertiseRegions",
        "WatchCompletions",
        "SubmitJob",
        "CloseSession",
    }
    # ... the explicit ids replaced it for their call only, and the fresh id is the
    # SubmitJob's own
    by_id = {e["request_id"]: str(e["method"]).rsplit("/", 1)[1] for e in calls}
    assert by_id["job-rid-7"] == "SubmitJob"
    assert by_id["sess-rid-9"] == "OpenSession"
    assert by_id[fresh] == "SubmitJob"
    # every call outside the block had an id of its own
    others = [e["request_id"] for e in calls if e["request_id"] != TRACE]
    assert len(others) == len(set(others))

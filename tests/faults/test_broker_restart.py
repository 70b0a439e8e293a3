"""Fault: the MQTT broker SIGKILLed under a working agent, then restarted on its port.

The agent (a process, `[mqtt] enabled`) keeps serving RPCs and jobs while the broker
is gone; per its backlog policy (dpu_agent/events/publisher.py) the completions of
those jobs wait in the backlog (nothing dropped while it has room) and reach the
broker once it is back; a subscriber connected to the restarted broker gets the
events of new jobs. The agent's side is read from its Prometheus endpoint.
"""

from __future__ import annotations

import asyncio
import collections
import os

import crc32c
import pytest

import host_client
from tests.faults.common import metric, scrape, until
from tests.integration.conftest import start_agent
from tests.integration.mqtt_broker import free_port, running_broker

pytestmark = pytest.mark.asyncio

AGENT_ID = "fault-broker"
JOBS = 40  # per phase: before the kill, while the broker is down, after the restart


async def _jobs(session: host_client.Session, count: int) -> set[int]:
    """Copies and CRCs by capsule and by SubmitJob, every byte checked; their job ids."""
    src = await session.alloc(64 << 10, readable=True)
    dst = await session.alloc(64 << 10, writable=True)
    ids = set()
    for index in range(count):
        data = os.urandom(64 << 10)
        src.view[:] = data
        if index % 2:
            if index % 4 == 1:
                job = await session.submit_rpc("crc32c", src)
            else:
                job = await session.submit_crc32c(src)
            done = (await job).raise_for_status()
            assert done.crc32c == crc32c.crc32c(data)
        else:
            if index % 4 == 0:
                job = await session.submit_copy(src, dst)
            else:
                job = await session.submit_rpc("copy", src, dst)
            (await job).raise_for_status()
            assert dst.view == data
        ids.add(job.job_id)
    await session.free(src)
    await session.free(dst)
    return ids


async def _events_of(stream, ids: set[int], seen: collections.Counter[int]) -> None:
    """Read completion events until every job in `ids` has been seen."""
    async with asyncio.timeout(60):
        async for event in stream:
            seen[event.job_id] += 1
            if ids <= set(seen):
                return


async def test_agent_serves_while_the_broker_is_killed_and_events_resume(tmp_path):
    metrics_address = f"127.0.0.1:{free_port()}"
    with running_broker(tmp_path) as broker:
        agent = start_agent(
            tmp_path,
            env={
                "DPU_AGENT_ID": AGENT_ID,
                "DPU_AGENT_MQTT_ENABLED": "true",
                "DPU_AGENT_MQTT_PORT": str(broker.port),
                "DPU_AGENT_MQTT_KEEPALIVE": "5",
                "DPU_AGENT_METRICS_LISTEN": metrics_address,
            },
        )
        try:
            async with (
                host_client.Client(agent.address, timeout=30) as client,
                await client.open_session(transport="tcp") as session,
            ):
                # 1. events flow
                async with (
                    host_client.EventSubscriber(broker.host, broker.port) as events,
                    events.completions(session=session.name) as stream,
                ):
                    seen: collections.Counter[int] = collections.Counter()
                    first = await _jobs(session, JOBS)
                    await _events_of(stream, first, seen)
                    # 2. the broker dies; the subscriber is told
                    broker.kill()
                    with pytest.raises(host_client.UnavailableError):
                        await _events_of(stream, {-1}, seen)  # until the stream fails

                async def disconnected() -> bool:
                    return metric(scrape(metrics_address), "dpu_agent_mqtt_connected") == 0

                await until(disconnected, "the agent to notice the broker is gone")
                before = scrape(metrics_address)

                # 3. the agent serves as if nothing happened
                assert await client.health() == "SERVING"
                assert (await client.agent_info()).name == f"agents/{AGENT_ID}"
                await client.create_volume("while-down", 1 << 20, crc32c=True)
                assert "volumes/while-down" in {v.name for v in await client.list_volumes()}
                while_down = await _jobs(session, JOBS)
                during = scrape(metrics_address)
                queued = metric(during, "dpu_agent_mqtt_events_queued_total")
                assert queued - metric(before, "dpu_agent_mqtt_events_queued_total") == JOBS
                assert metric(during, "dpu_agent_mqtt_backlog") >= JOBS, "completions not held"
                assert metric(during, "dpu_agent_mqtt_events_dropped_total") == 0
                assert metric(during, "dpu_agent_mqtt_connected") == 0

                # 4. the broker comes back on its port; the backlog drains
                broker.start()

                async def drained() -> bool:
                    now = scrape(metrics_address)
                    return (
                        metric(now, "dpu_agent_mqtt_connected") == 1
                        and metric(now, "dpu_agent_mqtt_backlog") == 0
                    )

                await until(drained, "the agent to reconnect and send its backlog", 90)
                after = scrape(metrics_address)
                assert metric(after, "dpu_agent_mqtt_reconnects_total") >= 1
                assert metric(after, "dpu_agent_mqtt_events_dropped_total") == 0
                assert metric(after, "dpu_agent_mqtt_events_published_total") == metric(
                    after, "dpu_agent_mqtt_events_queued_total"
                )

                # 5. a subscriber of the restarted broker gets new events
                async with (
                    host_client.EventSubscriber(broker.host, broker.port) as events,
                    events.completions(session=session.name) as stream,
                ):
                    seen = collections.Counter()
                    last = await _jobs(session, JOBS)
                    await _events_of(stream, last, seen)
                assert not (while_down & last), "job ids were reused"
                print(  # noqa: T201 - the numbers the report quotes
                    f"\nbroker down: {len(while_down)} jobs served, "
                    f"{int(metric(during, 'dpu_agent_mqtt_backlog'))} events held; after the "
                    f"restart {int(metric(after, 'dpu_agent_mqtt_reconnects_total'))} "
                    f"reconnect(s), backlog 0, {len(last)} new events received"
                )
        finally:
            assert agent.terminate() == 0, agent.log_path.read_text()

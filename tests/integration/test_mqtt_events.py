"""The event plane against a real mosquitto: delivery, status and will, outages, backlog."""

import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import aiomqtt
import pytest

from dpu_agent.dataplane.jobs import JobRecord, Origin
from dpu_agent.events import MqttEventPublisher, MqttSettings
from dpu_wire import events as payloads
from dpu_wire.capsule import JobKind, Span, State
from host_client import UnavailableError
from host_client._events import EventSubscriber, parse_completion
from tests.integration.mqtt_broker import MosquittoBroker, free_port, running_broker

pytestmark = pytest.mark.asyncio

AGENT = "dpu-0"
WAIT = 10.0  # seconds any one condition may take before the test fails
COMPLETIONS = payloads.completion_filter(payloads.DEFAULT_PREFIX)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def broker(tmp_path):
    with running_broker(tmp_path) as b:
        yield b


@pytest.fixture
def persistent_broker(tmp_path):
    """A broker that keeps sessions, subscriptions and queued messages across restarts."""
    with running_broker(tmp_path, persistence=True) as b:
        yield b


def settings(broker_port, **overrides):
    values: dict[str, Any] = {
        "port": broker_port,
        "telemetry_interval": 0.0,
        "reconnect_min": 0.05,
        "reconnect_max": 0.2,
        "keepalive": 5,
        "publish_timeout": 5.0,
        "flush_timeout": 5.0,
    }
    return MqttSettings(**{**values, **overrides})


def make_session(session_id="s-1a2b3c", tenant="default") -> types.SimpleNamespace:
    """What the publisher reads of a session: its tenant and id."""
    return types.SimpleNamespace(session_id=session_id, tenant=tenant)


def finished_job(job_id):
    kind = JobKind.CRC32C if job_id % 3 == 0 else JobKind.COPY
    job = JobRecord(job_id, kind, Span(0x1000, 512, 1), Span(), Origin.CAPSULE, 0.0)
    job.start()
    job.bytes_read = 512
    job.result = job_id
    if job_id % 5 == 4:
        job.finish(State.FAILED, 14, "data plane failed")
    else:
        job.finish(State.SUCCEEDED)
    return job


async def until(predicate, what, within=WAIT):
    """Wait for a condition (checked every 10 ms), failing with `what` after `within` s."""
    try:
        async with asyncio.timeout(within):
            while not predicate():  # noqa: ASYNC110 - counters have no event to wait on
                await asyncio.sleep(0.01)
    except TimeoutError:
        pytest.fail(f"timed out after {within} s waiting for: {what}")


async def take(iterator, count, within=WAIT):
    """The next `count` items of an async iterator, within `within` s."""
    items = []
    async with asyncio.timeout(within):
        async for item in iterator:
            items.append(item)
            if len(items) == count:
                break
    return items


@contextlib.asynccontextmanager
async def persistent_subscriber(broker, identifier="test-subscriber"):
    """A raw aiomqtt subscriber whose session (subscription, queued QoS 1 messages)
    the broker keeps while it is away: connect it, it gets what it missed."""
    client = aiomqtt.Client(
        broker.host, broker.port, identifier=identifier, clean_session=False, timeout=WAIT
    )
    async with client:
        await client.subscribe(COMPLETIONS, qos=1)
        yield client


async def completion_ids(client, count):
    """Job ids of the next `count` completions; returns once the broker has their PUBACKs.

    paho acknowledges each message after handing it over; a QoS 1 round trip behind
    those acknowledgements (one TCP stream, in order) proves the broker has them, so a
    broker restart cannot redeliver them.
    """
    messages = await take(client.messages, count)
    await client.publish("test/sync", b"", qos=1)
    return [parse_completion(str(m.topic), bytes(m.payload)).job_id for m in messages]


# ---------------------------------------------------------------------- delivery
async def test_each_completion_arrives_once_per_subscriber_in_order(broker):
    count = 2000
    session = make_session()
    async with (
        EventSubscriber(broker.host, broker.port) as first,
        EventSubscriber(broker.host, broker.port) as second,
        first.completions(agent_id=AGENT) as stream_1,
        second.completions(session="sessions/s-1a2b3c") as stream_2,
        second.completions(tenant="other") as not_mine,
        MqttEventPublisher(settings(broker.port), AGENT) as publisher,
    ):
        for job_id in range(count):
            publisher.publish_completion(session, finished_job(job_id))
        publisher.publish_completion(session, finished_job(10**9))  # the end marker
        for stream in (stream_1, stream_2):
            events = await take(stream, count + 1)
            assert [e.job_id for e in events] == [*range(count), 10**9]
            assert {e.agent_id for e in events} == {AGENT}
            crc_job = events[3].completion
            assert (crc_job.state, crc_job.crc32c, events[3].kind) == ("SUCCEEDED", 3, "CRC32C")
            failed = events[4].completion
            assert (failed.state, failed.code, failed.crc32c) == ("FAILED", "UNAVAILABLE", None)
            assert events[4].completion.message == "data plane failed"
        assert not_mine._queue.empty()
        stats = publisher.stats()
        assert stats["queued"] == stats["published"] == count + 1
        assert (stats["dropped"], stats["unsent"], stats["reconnects"]) == (0, 0, 0)


async def test_telemetry_reports_the_source_and_the_counters(broker):
    calls = []

    def source():
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("source broken")
        return {"sessions": len(calls)}

    async with (
        EventSubscriber(broker.host, broker.port) as events,
        events.telemetry(AGENT) as telemetry,
        MqttEventPublisher(
            settings(broker.port, telemetry_interval=0.02), AGENT, telemetry_source=source
        ) as publisher,
    ):
        got = await take(telemetry, 2)
        assert [t.stats for t in got] == [{"sessions": 1}, {"sessions": 2}]
        assert got[1].events["connected"] == 1
        assert got[0].time_ns <= got[1].time_ns
        await until(lambda: len(calls) >= 5, "the broken source was asked again")
        assert publisher.connected  # a failing source costs its reports, nothing else
        assert publisher.stats()["telemetry"] == 2


async def test_sdk_subscriber_reports_a_lost_broker_and_can_reconnect(broker):
    session = make_session()
    events = EventSubscriber(broker.host, broker.port)
    async with (
        MqttEventPublisher(settings(broker.port), AGENT) as publisher,
    ):
        await asyncio.wait_for(publisher.wait_connected(), WAIT)
        async with events, events.completions() as stream:
            broker.kill()
            with pytest.raises(UnavailableError, match="connection lost"):
                await asyncio.wait_for(anext(stream), WAIT)
        with pytest.raises(UnavailableError, match="event broker"):
            await events.__aenter__()
        broker.start()
        await until(lambda: publisher.stats()["reconnects"] == 1, "publisher reconnected")
        async with events, events.completions() as stream:
            publisher.publish_completion(session, finished_job(5))
            (event,) = await take(stream, 1)
            assert event.job_id == 5


async def test_sdk_subscription_lifecycle(broker):
    session = make_session()
    async with (
        EventSubscriber(broker.host, broker.port) as events,
        MqttEventPublisher(settings(broker.port), AGENT) as publisher,
    ):
        lazy = events.completions()  # subscribes on its first iteration
        first = asyncio.ensure_future(anext(lazy))
        await until(lambda: lazy.joined != 0, "lazy subscription sent")
        async with events.completions() as scoped:  # SUBACKs come in order: both are live
            publisher.publish_completion(session, finished_job(1))
            assert (await asyncio.wait_for(first, WAIT)).job_id == 1
            assert (await asyncio.wait_for(anext(scoped), WAIT)).job_id == 1
        with pytest.raises(StopAsyncIteration):
            await anext(scoped)
        assert scoped.joined == 0  # ended for good: no new broker subscription
        with pytest.raises(RuntimeError, match="make a new one"):
            await scoped.__aenter__()
        publisher.publish_completion(session, finished_job(2))
        assert (await asyncio.wait_for(anext(lazy), WAIT)).job_id == 2
    with pytest.raises(StopAsyncIteration):  # the subscriber closed: iterators end
        await anext(lazy)


# ---------------------------------------------------------------------- status and will
async def test_status_online_then_offline_on_stop(broker):
    async with EventSubscriber(broker.host, broker.port) as events:
        assert await events.agent_status(AGENT, wait=0.2) is None
        async with events.statuses(AGENT) as statuses:
            publisher = MqttEventPublisher(settings(broker.port), AGENT, version="9.9")
            async with publisher:
                (online,) = await take(statuses, 1)
                assert (online.state, online.version, online.reason) == ("online", "9.9", "")
                retained = await events.agent_status(AGENT)
                assert retained is not None
                assert (retained.online, retained.retained) == (True, True)
            (offline,) = await take(statuses, 1)
            assert (offline.state, offline.reason) == ("offline", "shutdown")
        after = await events.agent_status(AGENT)
        assert after is not None
        assert (after.state, after.reason, after.retained) == ("offline", "shutdown", True)
        assert after.started_ns == online.started_ns


async def test_cut_connection_fires_the_will_then_the_publisher_comes_back(broker):
    session = make_session()
    async with (
        EventSubscriber(broker.host, broker.port) as events,
        events.statuses(AGENT) as statuses,
        events.completions() as completions,
        MqttEventPublisher(settings(broker.port), AGENT) as publisher,
    ):
        (online,) = await take(statuses, 1)
        assert online.online
        assert publisher._mqtt is not None
        sock = publisher._mqtt._client.socket()
        assert isinstance(sock, socket.socket)
        sock.shutdown(socket.SHUT_RDWR)  # the link dies; no DISCONNECT is sent
        will, back = await take(statuses, 2)
        assert (will.state, will.reason) == ("offline", "connection lost")
        assert back.online
        await until(lambda: publisher.stats()["reconnects"] == 1, "publisher reconnected")
        publisher.publish_completion(session, finished_job(1))
        (event,) = await take(completions, 1)
        assert event.job_id == 1


async def test_agent_process_killed_leaves_offline_status(broker, tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(
        "import asyncio, sys\n"
        "from dpu_agent.events import MqttEventPublisher, MqttSettings\n"
        "async def main():\n"
        "    settings = MqttSettings(port=int(sys.argv[1]), telemetry_interval=0)\n"
        "    publisher = MqttEventPublisher(settings, 'doomed')\n"
        "    publisher.start()\n"
        "    await publisher.wait_connected()\n"
        "    print('connected', flush=True)\n"
        "    await asyncio.sleep(60)\n"
        "asyncio.run(main())\n"
    )
    async with (
        EventSubscriber(broker.host, broker.port) as events,
        events.statuses("doomed") as statuses,
    ):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(script), str(broker.port), stdout=subprocess.PIPE, cwd=REPO
        )
        try:
            assert proc.stdout is not None
            assert await asyncio.wait_for(proc.stdout.readline(), WAIT) == b"connected\n"
            (online,) = await take(statuses, 1)
            assert online.online
            proc.send_signal(signal.SIGKILL)
            (offline,) = await take(statuses, 1)
            assert (offline.state, offline.reason) == ("offline", "connection lost")
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()


async def test_cancelled_without_stop_still_says_offline(broker):
    async with (
        EventSubscriber(broker.host, broker.port) as events,
        events.statuses(AGENT) as statuses,
    ):
        publisher = MqttEventPublisher(settings(broker.port), AGENT)
        publisher.start()
        (online,) = await take(statuses, 1)
        assert online.online
        assert publisher._task is not None
        publisher._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await publisher._task
        (offline,) = await take(statuses, 1)
        assert offline.state == "offline"


# ---------------------------------------------------------------------- broker outages
async def test_broker_down_at_start_then_backlog_delivered_in_order(persistent_broker):
    broker = persistent_broker
    async with persistent_subscriber(broker):
        pass  # the broker now keeps this subscriber's subscription
    broker.stop()
    count = 500
    session = make_session()
    async with MqttEventPublisher(settings(broker.port), AGENT) as publisher:
        await until(lambda: publisher.stats()["connect_failures"] >= 2, "connection attempts")
        for job_id in range(count):
            publisher.publish_completion(session, finished_job(job_id))
        stats = publisher.stats()
        assert (stats["unsent"], stats["published"], stats["connected"]) == (count, 0, 0)
        broker.start()
        await asyncio.wait_for(publisher.wait_connected(), WAIT)
        await until(lambda: publisher.stats()["published"] == count, "backlog sent")
        stats = publisher.stats()
        assert (stats["queued"], stats["unsent"], stats["dropped"]) == (count, 0, 0)
        assert stats["reconnects"] == 0  # the first connection that worked
        assert stats["connect_failures"] >= 2
    async with persistent_subscriber(broker) as subscriber:
        assert await completion_ids(subscriber, count) == list(range(count))


async def test_broker_restart_then_events_resume(persistent_broker):
    broker = persistent_broker
    session = make_session()
    async with (
        persistent_subscriber(broker) as subscriber,
        MqttEventPublisher(settings(broker.port), AGENT) as publisher,
    ):
        await asyncio.wait_for(publisher.wait_connected(), WAIT)
        for job_id in range(100):
            publisher.publish_completion(session, finished_job(job_id))
        assert await completion_ids(subscriber, 100) == list(range(100))
        await until(lambda: publisher.stats()["published"] == 100, "first batch acknowledged")

        broker.stop()  # SIGTERM: the broker saves its sessions and goes away
        with pytest.raises(aiomqtt.MqttError):
            await asyncio.wait_for(anext(subscriber.messages), WAIT)
        await until(lambda: not publisher.connected, "publisher noticed")
        for job_id in range(100, 200):
            publisher.publish_completion(session, finished_job(job_id))
        assert publisher.stats()["unsent"] == 100

        broker.start()
        await until(lambda: publisher.stats()["reconnects"] == 1, "publisher reconnected")
        for job_id in range(200, 300):
            publisher.publish_completion(session, finished_job(job_id))
        await until(lambda: publisher.stats()["published"] == 300, "everything acknowledged")
    async with persistent_subscriber(broker) as subscriber:  # its first connection died
        assert await completion_ids(subscriber, 200) == list(range(100, 300))
    stats = publisher.stats()
    assert (stats["queued"], stats["unsent"], stats["dropped"]) == (300, 0, 0)


async def test_full_backlog_drops_the_newest_and_counts_them(tmp_path):
    broker = MosquittoBroker(tmp_path, port=free_port(), persistence=True)
    broker.start()
    try:
        async with persistent_subscriber(broker):
            pass
        broker.stop()
        session = make_session()
        async with MqttEventPublisher(settings(broker.port, backlog=50), AGENT) as publisher:
            for job_id in range(80):
                publisher.publish_completion(session, finished_job(job_id))
            stats = publisher.stats()
            assert (stats["queued"], stats["unsent"], stats["dropped"]) == (50, 50, 30)
            broker.start()
            await until(lambda: publisher.stats()["published"] == 50, "backlog sent")
            publisher.publish_completion(session, finished_job(1000))  # room again
            await until(lambda: publisher.stats()["published"] == 51, "new event sent")
        async with persistent_subscriber(broker) as subscriber:
            assert await completion_ids(subscriber, 51) == [*range(50), 1000]
    finally:
        broker.stop()


async def test_full_backlog_keeps_another_tenants_share(tmp_path):
    broker = MosquittoBroker(tmp_path, port=free_port(), persistence=True)
    broker.start()
    try:
        async with persistent_subscriber(broker):
            pass
        broker.stop()
        flooding = make_session("s-a", tenant="tenant-a")
        other = make_session("s-b", tenant="tenant-b")
        async with MqttEventPublisher(settings(broker.port, backlog=50), AGENT) as publisher:
            for job_id in range(80):
                publisher.publish_completion(flooding, finished_job(job_id))
            for job_id in range(1000, 1010):
                publisher.publish_completion(other, finished_job(job_id))
            stats = publisher.stats()  # tenant-b's 10 took the places of tenant-a's newest
            assert (stats["queued"], stats["unsent"], stats["dropped"]) == (60, 50, 40)
            broker.start()
            await until(lambda: publisher.stats()["published"] == 50, "backlog sent")
        async with persistent_subscriber(broker) as subscriber:
            received = await completion_ids(subscriber, 50)
        assert sorted(received) == [*range(40), *range(1000, 1010)]
        # the tenants took turns: tenant-b's ten among the first twenty
        assert sorted(received[:20]) == [*range(10), *range(1000, 1010)]
    finally:
        broker.stop()


async def test_stop_without_broker_is_bounded_and_counts_what_is_left():
    port = free_port()  # nobody listens here
    publisher = MqttEventPublisher(settings(port, flush_timeout=0.3), AGENT)
    publisher.start()
    for job_id in range(10):
        publisher.publish_completion(make_session(), finished_job(job_id))
    loop = asyncio.get_running_loop()
    started = loop.time()
    await publisher.stop()
    assert loop.time() - started < 2.0
    publisher.publish_completion(make_session(), finished_job(99))  # after stop: dropped
    stats = publisher.stats()
    assert (stats["unsent"], stats["published"], stats["dropped"]) == (10, 0, 1)
    assert stats["connect_failures"] >= 1


async def test_stop_while_disconnected_with_nothing_to_send_is_immediate():
    publisher = MqttEventPublisher(settings(free_port(), flush_timeout=5.0), AGENT)
    publisher.start()
    await until(lambda: publisher.stats()["connect_failures"] >= 1, "a failed attempt")
    loop = asyncio.get_running_loop()
    started = loop.time()
    await publisher.stop()
    assert loop.time() - started < 1.0  # not the 5 s flush timeout: nothing to flush

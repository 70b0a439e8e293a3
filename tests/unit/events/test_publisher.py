"""The publisher's producer side and settings, without a broker."""

import asyncio
import contextlib
import dataclasses
import types

import aiomqtt
import pytest

from dpu_agent.dataplane.jobs import JobRecord, Origin
from dpu_agent.events import MqttEventPublisher, MqttSettings, TopicError
from dpu_agent.events import publisher as publisher_module
from dpu_wire.capsule import JobKind, Span, State


def finished_job(job_id):
    job = JobRecord(job_id, JobKind.COPY, Span(), Span(), Origin.CAPSULE, 0.0)
    job.finish(State.SUCCEEDED)
    return job


def session(tenant="default"):
    """What the publisher reads of a session: its tenant and id."""
    return types.SimpleNamespace(tenant=tenant, session_id="s-1")


class SlowBroker:
    """Stands in for aiomqtt.Client: takes one QoS 1 message per event-loop pass.

    `sent` lists (tenant, job id) of the completions it acknowledged, in order. With
    `fail_after`, the link breaks once that many completions were acknowledged: the
    publish in progress fails, and so does every one after it on that connection.
    """

    def __init__(self, fail_after=None):
        self.sent: list[tuple[str, int]] = []
        self.fail_after = fail_after
        self._disconnected: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.messages = self._messages()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info):
        return None

    async def _messages(self):
        await asyncio.Event().wait()  # the link never ends by itself
        yield None

    async def publish(self, topic, *_payload_and_options, **_options):
        await asyncio.sleep(0)
        levels = topic.split("/")
        if levels[-1] != "completion":
            return  # status
        if self.fail_after is not None and len(self.sent) >= self.fail_after:
            raise aiomqtt.MqttError("link cut")
        self.sent.append((levels[levels.index("tenants") + 1], int(levels[-2])))


@contextlib.asynccontextmanager
async def publishing_to(brokers, **settings):
    """A started publisher whose connections are `brokers`, one per (re)connection."""
    values = {"telemetry_interval": 0.0, "window": 8, "reconnect_min": 0.01}
    publisher = MqttEventPublisher(MqttSettings(**{**values, **settings}), "dpu-0")
    connections = iter(brokers)
    publisher._client = lambda: next(connections)  # type: ignore[method-assign]
    publisher.start()
    try:
        yield publisher
    finally:
        await publisher.stop(flush_timeout=0.0)


async def until(predicate, within=5.0):
    async with asyncio.timeout(within):
        while not predicate():  # noqa: ASYNC110 - counters have no event to wait on
            await asyncio.sleep(0.001)


def take_waiting(publisher):
    """Empty the backlog of a publisher that is not started: (tenant, job id) in the
    order it would send them."""
    backlog, taken = publisher._backlog, []
    while len(backlog):
        message = backlog.pop()
        taken.append((message.tenant, int(message.topic.split("/")[-2])))
    return taken


def test_backlog_is_bounded_and_overflow_counted():
    publisher = MqttEventPublisher(MqttSettings(backlog=3), "dpu-0")
    s = session()
    for job_id in range(5):
        publisher.publish_completion(s, finished_job(job_id))
    stats = publisher.stats()
    assert (stats["queued"], stats["unsent"], stats["dropped"]) == (3, 3, 2)
    assert take_waiting(publisher) == [("default", 0), ("default", 1), ("default", 2)]


def test_full_backlog_is_shared_by_the_tenants_and_sent_in_turn():
    publisher = MqttEventPublisher(MqttSettings(backlog=10), "dpu-0")
    flooding, other = session("tenant-a"), session("tenant-b")
    for job_id in range(20):
        publisher.publish_completion(flooding, finished_job(job_id))
    assert (publisher.stats()["queued"], publisher.stats()["dropped"]) == (10, 10)
    # under its share (10 / 2 tenants), tenant-b's completions take the places of
    # tenant-a's newest; at its share, its own newest are refused
    for job_id in range(7):
        publisher.publish_completion(other, finished_job(job_id))
    publisher.publish_completion(flooding, finished_job(99))  # at its share: refused
    stats = publisher.stats()
    assert (stats["queued"], stats["unsent"], stats["dropped"]) == (15, 10, 10 + 5 + 2 + 1)
    a_jobs = [("tenant-a", job_id) for job_id in range(5)]
    b_jobs = [("tenant-b", job_id) for job_id in range(5)]
    assert take_waiting(publisher) == [
        job for pair in zip(a_jobs, b_jobs, strict=True) for job in pair
    ]


def test_a_backlog_full_of_messages_awaiting_pubacks_refuses_new_ones():
    publisher = MqttEventPublisher(MqttSettings(backlog=2), "dpu-0")
    for job_id in range(2):
        publisher.publish_completion(session("tenant-a"), finished_job(job_id))
    publisher._inflight = {seq: publisher._backlog.pop() for seq in range(2)}  # sent
    publisher.publish_completion(session("tenant-b"), finished_job(0))
    stats = publisher.stats()
    assert (stats["queued"], stats["unsent"], stats["dropped"]) == (2, 2, 1)


@pytest.mark.asyncio
async def test_a_flooding_tenant_cannot_get_anothers_completions_dropped():
    broker = SlowBroker()
    async with publishing_to([broker], backlog=100) as publisher:
        await publisher.wait_connected()
        flooding, other = session("tenant-a"), session("tenant-b")
        for job_id in range(1000):  # far more than the link takes meanwhile
            publisher.publish_completion(flooding, finished_job(job_id))
        assert publisher.stats()["dropped"] > 0  # tenant-a filled the backlog
        for job_id in range(20):
            publisher.publish_completion(other, finished_job(job_id))
        await until(lambda: publisher.stats()["unsent"] == 0)
    assert [job for tenant, job in broker.sent if tenant == "tenant-b"] == list(range(20))
    stats = publisher.stats()
    assert stats["published"] == len(broker.sent)
    assert stats["published"] + stats["dropped"] == 1020


@pytest.mark.asyncio
async def test_a_flooding_tenant_cannot_delay_another_much():
    broker = SlowBroker()
    window = 8
    async with publishing_to([broker], backlog=100_000, window=window) as publisher:
        await publisher.wait_connected()
        flooding, other = session("tenant-a"), session("tenant-b")
        for job_id in range(2000):
            publisher.publish_completion(flooding, finished_job(job_id))
        await until(lambda: len(broker.sent) >= 100)  # tenant-a's events on their way
        ahead = len(broker.sent)
        for job_id in range(10):
            publisher.publish_completion(other, finished_job(job_id))
        for job_id in range(2000, 4000):  # tenant-a keeps flooding
            publisher.publish_completion(flooding, finished_job(job_id))
        await until(lambda: ("tenant-b", 9) in broker.sent)
        # tenant-b's 10 events waited for those already in flight, then took turns
        # with tenant-a's: not behind the thousands of tenant-a's queued before them
        assert broker.sent.index(("tenant-b", 9)) - ahead < window + 2 * 10
    assert publisher.stats()["dropped"] == 0


@pytest.mark.asyncio
async def test_a_lost_link_resends_each_tenants_completions_in_order():
    brokers = [SlowBroker(fail_after=30), SlowBroker()]
    async with publishing_to(brokers) as publisher:
        for job_id in range(50):
            for tenant in ("tenant-a", "tenant-b", "tenant-c"):
                publisher.publish_completion(session(tenant), finished_job(job_id))
        await until(lambda: publisher.stats()["published"] == 150)
        assert publisher.stats()["reconnects"] == 1
    for tenant in ("tenant-a", "tenant-b", "tenant-c"):
        jobs = [job for name, job in brokers[0].sent + brokers[1].sent if name == tenant]
        assert jobs == list(range(50))
    assert publisher.stats()["unsent"] == 0


def test_publish_completion_never_raises():
    publisher = MqttEventPublisher(MqttSettings(), "dpu-0")
    publisher.publish_completion(session(tenant="bad/tenant"), finished_job(1))
    unfinished = JobRecord(2, JobKind.COPY, Span(), Span(), Origin.CAPSULE, 0.0)
    publisher.publish_completion(session(), unfinished)
    assert publisher.stats()["rejected"] == 2
    assert publisher.stats()["unsent"] == 0


def test_stats_are_the_documented_counters():
    stats = MqttEventPublisher(MqttSettings(), "dpu-0").stats()
    assert set(stats) == {
        "queued",
        "published",
        "dropped",
        "rejected",
        "unsent",
        "reconnects",
        "connect_failures",
        "telemetry",
        "connected",
    }
    assert all(v == 0 for v in stats.values())


def test_password_is_not_in_the_repr():
    settings = MqttSettings(username="agent", password="hunter2")  # noqa: S106 - a dummy
    assert "hunter2" not in repr(settings)
    assert "agent" in repr(settings)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("port", 0),
        ("port", 70000),
        ("keepalive", 1),
        ("backlog", 0),
        ("window", 0),
        ("telemetry_interval", -1.0),
        ("reconnect_min", 0.0),
        ("reconnect_min", 60.0),
        ("publish_timeout", 0.0),
        ("flush_timeout", -1.0),
    ],
)
def test_settings_out_of_range(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(MqttSettings(), **{field: value})


def test_settings_refuse_a_wildcard_prefix():
    with pytest.raises(TopicError):
        MqttSettings(topic_prefix="dpu/#")


def test_agent_id_must_be_a_topic_level():
    with pytest.raises(TopicError):
        MqttEventPublisher(MqttSettings(), "a/b")


@pytest.mark.parametrize(
    ("attempt", "low", "high"),
    [(1, 0.5, 30.0), (2, 0.5, 30.0), (5, 0.5, 30.0), (20, 0.5, 30.0), (1000, 0.5, 30.0)],
)
def test_backoff_doubles_up_to_the_cap_with_jitter(attempt, low, high):
    ceiling = min(high, low * 2 ** (attempt - 1))
    delays = [publisher_module._backoff(attempt, low, high) for _ in range(200)]
    assert all(ceiling / 2 <= d <= ceiling for d in delays)
    assert len(set(delays)) > 1

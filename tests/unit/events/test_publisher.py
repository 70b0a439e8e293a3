"""The publisher's producer side and settings, without a broker."""

import dataclasses
import types

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


def test_backlog_is_bounded_and_overflow_counted():
    publisher = MqttEventPublisher(MqttSettings(backlog=3), "dpu-0")
    s = session()
    for job_id in range(5):
        publisher.publish_completion(s, finished_job(job_id))
    stats = publisher.stats()
    assert (stats["queued"], stats["unsent"], stats["dropped"]) == (3, 3, 2)
    assert [m.topic.split("/")[-2] for m in publisher._backlog] == ["0", "1", "2"]


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

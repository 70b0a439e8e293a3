"""The event plane's wire format: topics, payloads, and the SDK parsing them back."""

import hashlib
import json
import types
from typing import Any, cast

import pytest

from dpu_agent.dataplane.jobs import JobRecord, Origin
from dpu_agent.dataplane.manager import ManagerSettings, SessionManager
from dpu_agent.dataplane.session import SessionState
from dpu_wire import events as payloads
from dpu_wire.capsule import JobKind, Span, State
from host_client import _events

T0 = 1_700_000_000_123_456_789  # 2023-11-14T22:13:20.123456789Z


def finished_job(
    job_id=7,
    kind=JobKind.COPY,
    state=State.SUCCEEDED,
    code=0,
    message="",
    *,
    started=True,
    result=0,
    request_id="",
    origin=Origin.CAPSULE,
    rpc_request_id="",
):
    job = JobRecord(
        job_id=job_id,
        kind=kind,
        source=Span(0x1000, 4096, 1),
        destination=Span(0x2000, 4096, 2) if kind == JobKind.COPY else Span(),
        origin=origin,
        deadline=0.0,
        request_id=request_id,
        rpc_request_id=rpc_request_id,
        submit_ns=T0,
    )
    if started:
        job.start()
        job.start_ns = T0 + 1_000
    job.bytes_read = 4096
    job.bytes_written = 4096 if kind == JobKind.COPY else 0
    job.result = result
    assert job.finish(state, code, message)
    job.end_ns = T0 + 2_000
    return job


# ---------------------------------------------------------------------- topics
@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (lambda: payloads.status_topic("dpu/v1", "dpu-0"), "dpu/v1/agents/dpu-0/status"),
        (lambda: payloads.telemetry_topic("dpu/v1", "dpu-0"), "dpu/v1/agents/dpu-0/telemetry"),
        (lambda: payloads.status_topic("lab/rack-3/dpu", "a"), "lab/rack-3/dpu/agents/a/status"),
        (
            lambda: payloads.completion_topic("dpu/v1", "dpu-0", "default", "s-1", 7),
            "dpu/v1/agents/dpu-0/tenants/default/sessions/s-1/jobs/7/completion",
        ),
        (
            lambda: payloads.completion_topic("dpu/v1", "a", "t", "s", 2**64 - 1),
            f"dpu/v1/agents/a/tenants/t/sessions/s/jobs/{2**64 - 1}/completion",
        ),
        (
            lambda: payloads.completion_filter("dpu/v1"),
            "dpu/v1/agents/+/tenants/+/sessions/+/jobs/+/completion",
        ),
        (
            lambda: payloads.completion_filter("dpu/v1", "dpu-0", session_id="s-1"),
            "dpu/v1/agents/dpu-0/tenants/+/sessions/s-1/jobs/+/completion",
        ),
    ],
)
def test_topics(build, expected):
    assert build() == expected


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: payloads.status_topic("dpu/v1", ""), "agent id is empty"),
        (lambda: payloads.status_topic("dpu/v1", "a/b"), "contains '/'"),
        (lambda: payloads.completion_topic("dpu/v1", "a", "t+", "s", 1), "tenant .* contains"),
        (lambda: payloads.completion_topic("dpu/v1", "a", "t", "#", 1), "session id"),
        (lambda: payloads.completion_topic("dpu/v1", "a", "t\x00", "s", 1), "tenant"),
        (lambda: payloads.completion_filter("dpu/v1", tenant="a/b"), "tenant"),
        (lambda: payloads.check_prefix("$SYS/x"), "reserved"),
        (lambda: payloads.check_prefix("dpu//v1"), "is empty"),
        (lambda: payloads.check_prefix("/dpu"), "is empty"),
        (lambda: payloads.check_prefix("dpu/+"), "contains"),
        (lambda: payloads.completion_topic("x" * 70000, "a", "t", "s", 1), "longer than"),
    ],
)
def test_bad_topic_levels_are_refused(build, message):
    with pytest.raises(payloads.TopicError, match=message):
        build()


# ---------------------------------------------------------------------- times
@pytest.mark.parametrize(
    ("ns", "text"),
    [
        (0, None),
        (-5, None),
        (1, "1970-01-01T00:00:00.000000001Z"),
        (T0, "2023-11-14T22:13:20.123456789Z"),
        (1_000_000_000, "1970-01-01T00:00:01.000000000Z"),
        (253402300799_999999999, "9999-12-31T23:59:59.999999999Z"),
    ],
)
def test_rfc3339_is_exact_to_the_nanosecond(ns, text):
    assert payloads.rfc3339(ns) == text
    assert _events.parse_time(text) == max(ns, 0)


@pytest.mark.parametrize(
    ("text", "ns"),
    [
        ("2023-11-14T22:13:20Z", 1_700_000_000_000_000_000),
        ("2023-11-14T22:13:20.5Z", 1_700_000_000_500_000_000),
        ("2023-11-14T23:13:20.000001+01:00", 1_700_000_000_000_001_000),
        ("2023-11-14t22:13:20.123456789z", T0),
    ],
)
def test_sdk_parses_other_rfc3339_forms(text, ns):
    assert _events.parse_time(text) == ns


@pytest.mark.parametrize("text", ["2023-11-14 22:13:20Z", "2023-11-14T22:13:20", "yesterday", ""])
def test_sdk_refuses_what_is_not_rfc3339(text):
    with pytest.raises(ValueError, match="RFC 3339"):
        _events.parse_time(text)


# ---------------------------------------------------------------------- completions
@pytest.mark.parametrize(
    ("job", "expected"),
    [
        (
            finished_job(),
            {
                "kind": "COPY",
                "state": "SUCCEEDED",
                "status": {"code": 0, "message": ""},
                "bytes_written": 4096,
            },
        ),
        (
            finished_job(kind=JobKind.CRC32C, result=0x1_E3069283),
            {"kind": "CRC32C", "state": "SUCCEEDED", "crc32c": 0xE3069283, "bytes_written": 0},
        ),
        (
            finished_job(kind=JobKind.CRC32C, state=State.FAILED, code=14, message="qp error"),
            {"state": "FAILED", "status": {"code": 14, "message": "qp error"}},
        ),
        (
            finished_job(state=State.CANCELLED, code=1, message="cancelled", started=False),
            {"state": "CANCELLED", "start_time": None},
        ),
        (
            finished_job(
                job_id=2**63, origin=Origin.GRPC, request_id="key-1", rpc_request_id="req-1"
            ),
            {"job_id": 2**63, "origin": "grpc", "request_id": "req-1"},
        ),
        (
            finished_job(request_id="", rpc_request_id="open-1"),
            {"origin": "capsule", "request_id": "open-1"},
        ),
    ],
)
def test_completion_payload(job, expected):
    document = json.loads(payloads.completion_payload("s-1a2b3c", job))
    assert list(document)[:8] == [
        "job",
        "job_id",
        "kind",
        "origin",
        "state",
        "status",
        "bytes_read",
        "bytes_written",
    ]
    assert document["job"] == f"sessions/s-1a2b3c/jobs/{job.job_id}"
    assert document["submit_time"] == "2023-11-14T22:13:20.123456789Z"
    assert document["end_time"] == "2023-11-14T22:13:20.123458789Z"
    assert ("crc32c" in document) == ("crc32c" in expected)
    for key, value in expected.items():
        assert document[key] == value, key


def sha256_job(state=State.SUCCEEDED):
    job = JobRecord(
        2**63 + 3,
        JobKind.SHA256,
        Span(0x1000, 4096, 1),
        Span(0x2000, 32, 2),
        Origin.GRPC,
        0.0,
        request_id="order-42-sha",
        rpc_request_id="call-9",
        submit_ns=T0,
    )
    job.start()
    if state == State.SUCCEEDED:
        job.digest = hashlib.sha256(b"x" * 4096).digest()
        job.bytes_read, job.bytes_written, job.result = 4096, 32, 32
    assert job.finish(state, 0 if state == State.SUCCEEDED else 14, "")
    return job


def test_sha256_completion_carries_the_digest_in_hex():
    job = sha256_job()
    document = json.loads(payloads.completion_payload("s-1", job))
    assert document["sha256"] == hashlib.sha256(b"x" * 4096).hexdigest()
    assert bytes.fromhex(document["sha256"]) == job.digest
    assert "crc32c" not in document
    topic = payloads.completion_topic("dpu/v1", "dpu-0", "default", "s-1", job.job_id)
    event = _events.parse_completion(topic, payloads.completion_payload("s-1", job))
    assert event.completion.sha256 == job.digest
    assert event.completion.crc32c is None


@pytest.mark.parametrize(
    "job",
    [
        sha256_job(State.FAILED),
        finished_job(kind=JobKind.CRC32C, result=5),
        finished_job(),
    ],
)
def test_only_a_succeeded_sha256_job_has_a_digest(job):
    document = json.loads(payloads.completion_payload("s-1", job))
    assert "sha256" not in document
    topic = payloads.completion_topic("dpu/v1", "a", "t", "s-1", job.job_id)
    event = _events.parse_completion(topic, payloads.completion_payload("s-1", job))
    assert event.completion.sha256 is None


@pytest.mark.parametrize("job_id", [0, 7, 2**53 + 1, 2**63, 2**64 - 1])
def test_job_id_string_is_the_exact_decimal_id(job_id):
    payload = payloads.completion_payload("s-1", finished_job(job_id=job_id))
    document = json.loads(payload)
    assert document["job_id_string"] == str(job_id)
    assert int(document["job_id_string"]) == document["job_id"] == job_id
    # a parser reading numbers as doubles (JavaScript) still gets it exactly
    lossy = json.loads(payload, parse_int=float)
    assert lossy["job_id_string"] == str(job_id)
    assert payloads.completion_topic("p", "a", "t", "s-1", job_id).split("/")[-2] == str(job_id)


def test_completion_names_both_request_ids():
    job = sha256_job()
    document = json.loads(payloads.completion_payload("s-1", job))
    assert document["request_id"] == "call-9"  # the SubmitJob call's x-request-id
    assert document["submit_request_id"] == "order-42-sha"  # its idempotency key
    topic = payloads.completion_topic("dpu/v1", "a", "t", "s-1", job.job_id)
    event = _events.parse_completion(topic, payloads.completion_payload("s-1", job))
    assert (event.request_id, event.submit_request_id) == ("call-9", "order-42-sha")
    capsule = json.loads(payloads.completion_payload("s-1", finished_job(rpc_request_id="o")))
    assert (capsule["request_id"], capsule["submit_request_id"]) == ("o", "")


def test_sdk_reads_a_completion_without_the_added_fields():
    """An older agent's completion (no sha256, job_id_string, submit_request_id)."""
    job = finished_job(job_id=9)
    document = json.loads(payloads.completion_payload("s-1", job))
    for key in ("job_id_string", "submit_request_id"):
        del document[key]
    topic = payloads.completion_topic("dpu/v1", "a", "t", "s-1", 9)
    event = _events.parse_completion(topic, json.dumps(document).encode())
    assert (event.job_id, event.submit_request_id, event.completion.sha256) == (9, "", None)


def test_completion_of_an_unfinished_job_is_refused():
    job = JobRecord(1, JobKind.COPY, Span(), Span(), Origin.CAPSULE, 0.0)
    with pytest.raises(ValueError, match="has not finished"):
        payloads.completion_payload("s-1", job)


@pytest.mark.parametrize(
    "job",
    [
        finished_job(),
        finished_job(kind=JobKind.CRC32C, result=123),
        finished_job(state=State.FAILED, code=4, message="deadline é"),
        finished_job(state=State.CANCELLED, code=1, started=False),
        finished_job(job_id=2**64 - 1, origin=Origin.GRPC, rpc_request_id="r"),
    ],
)
def test_sdk_reads_back_what_the_agent_writes(job):
    topic = payloads.completion_topic("dpu/v1", "dpu-0", "default", "s-1a2b3c", job.job_id)
    event = _events.parse_completion(topic, payloads.completion_payload("s-1a2b3c", job))
    c = job.completion
    assert (event.agent_id, event.tenant, event.session_id) == ("dpu-0", "default", "s-1a2b3c")
    assert event.job == f"sessions/s-1a2b3c/jobs/{job.job_id}"
    assert event.job_id == job.job_id
    assert event.kind == job.kind.name
    assert event.origin == job.origin.value
    assert event.request_id == job.rpc_request_id
    got = event.completion
    assert got.state == State(c.state).name
    assert got.code == {0: "OK", 1: "CANCELLED", 4: "DEADLINE_EXCEEDED"}[c.status]
    assert got.message == c.message
    assert (got.bytes_read, got.bytes_written) == (c.bytes_read, c.bytes_written)
    assert (got.submit_ns, got.start_ns, got.end_ns) == (c.submit_ns, c.start_ns, c.end_ns)
    expected_crc = c.result if job.kind == JobKind.CRC32C and c.status == 0 else None
    assert got.crc32c == expected_crc


@pytest.mark.parametrize(
    ("topic", "payload"),
    [
        ("dpu/v1/agents/a/status", b"{}"),
        ("other/agents/a/tenants/t/sessions/s/jobs/1/completion", b"{}"),
        ("dpu/v1/agents/a/tenants/t/sessions/s/jobs/1/completion", b"not json"),
        ("dpu/v1/agents/a/tenants/t/sessions/s/jobs/1/completion", b"[1]"),
        ("dpu/v1/agents/a/tenants/t/sessions/s/jobs/1/completion", b'{"job": "x"}'),
    ],
)
def test_sdk_refuses_malformed_completions(topic, payload):
    with pytest.raises((ValueError, TypeError, KeyError)):
        _events.parse_completion(topic, payload)


# ---------------------------------------------------------------------- status, telemetry
@pytest.mark.parametrize(
    ("state", "reason", "expected"),
    [
        (
            "online",
            "ignored",
            {
                "state": "online",
                "agent": "dpu-0",
                "version": "1.2",
                "started": payloads.rfc3339(T0),
            },
        ),
        (
            "offline",
            payloads.REASON_SHUTDOWN,
            {
                "state": "offline",
                "agent": "dpu-0",
                "version": "1.2",
                "started": payloads.rfc3339(T0),
                "reason": "shutdown",
            },
        ),
        (
            "offline",
            payloads.REASON_CONNECTION_LOST,
            {
                "state": "offline",
                "agent": "dpu-0",
                "version": "1.2",
                "started": payloads.rfc3339(T0),
                "reason": "connection lost",
            },
        ),
    ],
)
def test_status_payload_and_its_parse(state, reason, expected):
    payload = payloads.status_payload(state, "dpu-0", "1.2", T0, reason)
    assert json.loads(payload) == expected
    status = _events.parse_status("dpu/v1/agents/dpu-0/status", payload, retained=True)
    assert status.agent_id == "dpu-0"
    assert status.online == (state == "online")
    assert status.reason == expected.get("reason", "")
    assert (status.version, status.started_ns, status.retained) == ("1.2", T0, True)


def test_telemetry_payload_and_its_parse():
    payload = payloads.telemetry_payload(
        "dpu-0", T0, 12.34567, {"sessions": 2, "by": {"x": 1}}, {"published": 5}
    )
    assert json.loads(payload) == {
        "agent": "dpu-0",
        "time": "2023-11-14T22:13:20.123456789Z",
        "uptime_s": 12.346,
        "stats": {"sessions": 2, "by": {"x": 1}},
        "events": {"published": 5},
    }
    report = _events.parse_telemetry("dpu/v1/agents/dpu-0/telemetry", payload)
    assert (report.agent_id, report.time_ns, report.uptime_s) == ("dpu-0", T0, 12.346)
    assert report.stats == {"sessions": 2, "by": {"x": 1}}
    assert report.events == {"published": 5}


def test_session_telemetry_sums_the_sessions():
    def fake(state, **counters):
        c = types.SimpleNamespace(
            jobs_submitted=0, jobs_completed=0, jobs_failed=0, bytes_read=0, bytes_written=0
        )
        vars(c).update(counters)
        return types.SimpleNamespace(state=state, counters=c, open_jobs=0)

    manager = SessionManager(ManagerSettings(), {}, reactor=cast("Any", None))
    manager._sessions = {
        "s-a": fake(SessionState.ACTIVE, jobs_submitted=5, jobs_completed=4, bytes_read=100),
        "s-b": fake(SessionState.ACTIVE, jobs_submitted=3, jobs_failed=1, bytes_written=50),
        "s-c": fake(SessionState.FAILED),
    }
    assert manager.telemetry() == {
        "sessions": 3,
        "sessions_by_state": {"ACTIVE": 2, "FAILED": 1},
        "open_jobs": 0,
        "jobs_submitted": 8,
        "jobs_completed": 4,
        "jobs_failed": 1,
        "bytes_read": 100,
        "bytes_written": 50,
    }
    manager._sessions = {}
    assert manager.telemetry()["sessions"] == 0

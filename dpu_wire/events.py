"""The event plane's wire format: MQTT topics and JSON payloads, as pure functions.

Shared by both sides and doing no I/O: the agent's publisher
(`dpu_agent.events.publisher`) sends what these functions build, and the host SDK
(`host_client._events`) builds its subscription filters here and parses the same
format; a unit test round-trips one through the other.

The contract (every topic, QoS, retain flag, when each message is sent, every payload
field) is docs/events.md; tests/unit/events/test_events_doc.py fails when a payload
gains a field that page does not list. In short (``{prefix}`` is
`MqttSettings.topic_prefix`, ``dpu/v1`` by default):

    {prefix}/agents/{agent}/status          QoS 1, retained; also the MQTT will
    {prefix}/agents/{agent}/telemetry       QoS 0, every telemetry interval
    {prefix}/agents/{agent}/tenants/{tenant}/sessions/{session}/jobs/{job_id}/completion
                                            QoS 1, one per finished job

Payloads are UTF-8 JSON objects. Consumers must ignore keys they do not know; a key
is never removed or retyped within ``v1``.
"""

from __future__ import annotations

import functools
import json
import time
from typing import TYPE_CHECKING, Final, Literal, Protocol

from dpu_wire.capsule import State
from dpu_wire.jobkinds import KINDS, JobKind, Result

if TYPE_CHECKING:
    import enum
    from collections.abc import Mapping

DEFAULT_PREFIX: Final = "dpu/v1"
STATUS_ONLINE: Final = "online"
STATUS_OFFLINE: Final = "offline"
REASON_SHUTDOWN: Final = "shutdown"
REASON_CONNECTION_LOST: Final = "connection lost"

_FORBIDDEN: Final = frozenset("/+#\x00")
_MAX_TOPIC_BYTES: Final = 65535
_NS: Final = 1_000_000_000


class FinishedJob(Protocol):
    """What a completion payload is made of (the agent's job record has these)."""

    @property
    def job_id(self) -> int:
        """The job id."""

    @property
    def kind(self) -> JobKind:
        """The job kind."""

    @property
    def origin(self) -> enum.Enum:
        """How it arrived (its value: "capsule" or "grpc")."""

    @property
    def state(self) -> int:
        """dpu.v1.JobState: SUCCEEDED, FAILED or CANCELLED."""

    @property
    def status(self) -> int:
        """The gRPC status code number."""

    @property
    def message(self) -> str:
        """Why it failed."""

    @property
    def bytes_read(self) -> int:
        """Bytes READ from host memory."""

    @property
    def bytes_written(self) -> int:
        """Bytes WRITTEN to host memory."""

    @property
    def result(self) -> int:
        """The kind's result (CRC32C: the CRC)."""

    @property
    def submit_ns(self) -> int:
        """When it arrived (ns since the epoch)."""

    @property
    def start_ns(self) -> int:
        """When it started (0: never)."""

    @property
    def end_ns(self) -> int:
        """When it ended."""

    @property
    def rpc_request_id(self) -> str:
        """The x-request-id of the RPC that made it."""

    @property
    def request_id(self) -> str:
        """SubmitJob's `request_id` field, its idempotency key ("" for capsule jobs)."""

    @property
    def digest(self) -> bytes:
        """SHA256: the 32-byte digest (b"" for other kinds, or before it is known)."""


class TopicError(ValueError):
    """A topic level or prefix cannot be used in an MQTT topic."""


def check_level(value: str, what: str) -> str:
    """Return `value` if it can be one topic level, else raise TopicError."""
    if not value:
        raise TopicError(f"{what} is empty")
    bad = _FORBIDDEN.intersection(value)
    if bad:
        raise TopicError(f"{what} {value!r} contains {''.join(sorted(bad))!r}")
    return value


def check_prefix(prefix: str) -> str:
    """Return `prefix` if it can start a topic: levels joined by '/', no wildcards or '$'."""
    if prefix.startswith("$"):
        raise TopicError(f"topic prefix {prefix!r} starts with '$' (reserved for the broker)")
    for level in prefix.split("/"):
        check_level(level, f"a level of topic prefix {prefix!r}")
    return prefix


def _join(*levels: str) -> str:
    topic = "/".join(levels)
    if len(topic.encode()) > _MAX_TOPIC_BYTES:
        raise TopicError(f"topic is longer than {_MAX_TOPIC_BYTES} bytes")
    return topic


def status_topic(prefix: str, agent_id: str) -> str:
    """``{prefix}/agents/{agent}/status``."""
    return _join(prefix, "agents", check_level(agent_id, "agent id"), "status")


def telemetry_topic(prefix: str, agent_id: str) -> str:
    """``{prefix}/agents/{agent}/telemetry``."""
    return _join(prefix, "agents", check_level(agent_id, "agent id"), "telemetry")


def completion_topic(prefix: str, agent_id: str, tenant: str, session_id: str, job_id: int) -> str:
    """``{prefix}/agents/{agent}/tenants/{tenant}/sessions/{session}/jobs/{job_id}/completion``."""
    return _join(
        prefix,
        "agents",
        check_level(agent_id, "agent id"),
        "tenants",
        check_level(tenant, "tenant"),
        "sessions",
        check_level(session_id, "session id"),
        "jobs",
        str(job_id),
        "completion",
    )


def completion_filter(
    prefix: str, agent_id: str = "+", tenant: str = "+", session_id: str = "+"
) -> str:
    """Subscription filter for completions; "+" matches any agent, tenant or session."""
    levels = {"agent id": agent_id, "tenant": tenant, "session id": session_id}
    for what, value in levels.items():
        if value != "+":
            check_level(value, what)
    return _join(
        prefix,
        "agents",
        agent_id,
        "tenants",
        tenant,
        "sessions",
        session_id,
        "jobs",
        "+",
        "completion",
    )


def rfc3339(ns: int) -> str | None:
    """Nanoseconds since the epoch as RFC 3339 UTC with nine fractional digits; None for 0."""
    if ns <= 0:
        return None
    seconds, fraction = divmod(ns, _NS)
    return f"{_utc_seconds(seconds)}.{fraction:09d}Z"


@functools.lru_cache(maxsize=16)
def _utc_seconds(seconds: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))


_ENCODER: Final = json.JSONEncoder(separators=(",", ":"))  # ASCII, so UTF-8 too


def _dumps(document: Mapping[str, object]) -> bytes:
    return _ENCODER.encode(document).encode()


def status_document(
    state: Literal["online", "offline"],
    agent_id: str,
    version: str,
    started_ns: int,
    reason: str = "",
) -> dict[str, object]:
    """The status object; `reason` is included for "offline" only."""
    document: dict[str, object] = {
        "state": state,
        "agent": agent_id,
        "version": version,
        "started": rfc3339(started_ns),
    }
    if state == STATUS_OFFLINE:
        document["reason"] = reason
    return document


def status_payload(
    state: Literal["online", "offline"],
    agent_id: str,
    version: str,
    started_ns: int,
    reason: str = "",
) -> bytes:
    """The retained status message."""
    return _dumps(status_document(state, agent_id, version, started_ns, reason))


def completion_document(session_id: str, job: FinishedJob) -> dict[str, object]:
    """The completion object of a finished job (docs/events.md, "Completion")."""
    if job.state not in (State.SUCCEEDED, State.FAILED, State.CANCELLED):
        raise ValueError(f"job {job.job_id} has not finished")
    document: dict[str, object] = {
        "job": f"sessions/{session_id}/jobs/{job.job_id}",
        "job_id": job.job_id,
        "kind": JobKind(job.kind).name,
        "origin": job.origin.value,
        "state": State(job.state).name,
        "status": {"code": job.status, "message": job.message},
        "bytes_read": job.bytes_read,
        "bytes_written": job.bytes_written,
    }
    if job.state == State.SUCCEEDED:
        if KINDS[JobKind(job.kind)].result is Result.CRC32C:
            document["crc32c"] = job.result & 0xFFFF_FFFF
        elif job.kind == JobKind.SHA256 and job.digest:
            document["sha256"] = job.digest.hex()
    document["submit_time"] = rfc3339(job.submit_ns)
    document["start_time"] = rfc3339(job.start_ns)
    document["end_time"] = rfc3339(job.end_ns)
    document["request_id"] = job.rpc_request_id
    # Added in v1 after the fields above, so they keep their order.
    document["job_id_string"] = str(job.job_id)
    document["submit_request_id"] = job.request_id
    return document


def completion_payload(session_id: str, job: FinishedJob) -> bytes:
    """The completion message of a finished job."""
    return _dumps(completion_document(session_id, job))


def telemetry_payload(
    agent_id: str,
    now_ns: int,
    uptime_s: float,
    stats: Mapping[str, object],
    events: Mapping[str, int],
) -> bytes:
    """The telemetry message; `stats` must be JSON-serialisable."""
    return _dumps(
        {
            "agent": agent_id,
            "time": rfc3339(now_ns),
            "uptime_s": round(uptime_s, 3),
            "stats": dict(stats),
            "events": dict(events),
        }
    )

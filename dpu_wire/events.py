"""The event plane's wire format: MQTT topics and JSON payloads, as pure functions.

Shared by both sides and doing no I/O: the agent's publisher
(`dpu_agent.events.publisher`) sends what these functions build, and the host SDK
(`host_client._events`) builds its subscription filters here and parses the same
format; a unit test round-trips one through the other.

Topics (``{prefix}`` is `MqttSettings.topic_prefix`, ``dpu/v1`` by default; every other
level is one topic level, never empty and never containing ``/``, ``+``, ``#`` or NUL):

    {prefix}/agents/{agent}/status
        QoS 1, retained. "online" when the agent connects; "offline" on a clean stop,
        and as the MQTT will when the connection is lost without one (crash, cut link).
    {prefix}/agents/{agent}/tenants/{tenant}/sessions/{session}/jobs/{job_id}/completion
        QoS 1, not retained. One per finished job.
    {prefix}/agents/{agent}/telemetry
        QoS 0, not retained. Every telemetry interval while connected.

``{agent}`` is the agent id (``dpu-0``), ``{session}`` the session id (``s-1a2b3c``, the
last part of the resource name ``sessions/s-1a2b3c``), ``{job_id}`` the job id in decimal.
Subscribe to ``{prefix}/agents/+/tenants/+/sessions/+/jobs/+/completion`` for every
completion of every agent.

Payloads are UTF-8 JSON objects, keys in the order shown. Integers are JSON numbers
(job ids reach 2**64 - 1: JavaScript consumers need a big-integer parser, or the
``job`` name). Times are RFC 3339 in UTC with nine fractional digits
(``2025-01-31T12:00:00.123456789Z``), or ``null`` when unset. Consumers must ignore
keys they do not know; a key is never removed or retyped within ``v1``.

Status (retained; the broker's copy is the agent's last known state)::

    {"state": "online", "agent": "dpu-0", "version": "0.1.0",
     "started": "2025-01-31T12:00:00.000000000Z"}
    {"state": "offline", "agent": "dpu-0", "version": "0.1.0",
     "started": "...", "reason": "shutdown"}            # clean stop
    {"state": "offline", "agent": "dpu-0", "version": "0.1.0",
     "started": "...", "reason": "connection lost"}     # the MQTT will: crash, cut link

Completion (one per finished job; QoS 1, so a subscriber may see a duplicate after a
reconnection, never a loss while the agent's backlog holds)::

    {"job": "sessions/s-1a2b3c/jobs/7",   # the job's resource name
     "job_id": 7,
     "kind": "COPY",                      # the job kind (dpu_wire.jobkinds.JobKind name)
     "origin": "capsule",                 # capsule (data plane) or grpc (SubmitJob)
     "state": "SUCCEEDED",                # SUCCEEDED, FAILED, CANCELLED
     "status": {"code": 0, "message": ""},  # gRPC status code number and why
     "bytes_read": 4096,
     "bytes_written": 4096,
     "crc32c": 3817498742,                # only for a CRC32C job that SUCCEEDED
     "submit_time": "...", "start_time": "..." or null, "end_time": "...",
     "request_id": "4f1c...",             # x-request-id of the RPC that made the job:
                                          # its SubmitJob, or for a capsule job its
                                          # session's OpenSession ("" when none); the
                                          # agent's log lines of that RPC carry it too
     "job_id_string": "7",                # job_id in decimal (lossless without
                                          # 64-bit integer JSON parsing)
     "submit_request_id": ""}             # SubmitJob's request_id field (idempotency
                                          # key; GetJob's request_id); "" for capsules
    # and, for a SHA256 job that SUCCEEDED, "sha256": the digest in lowercase hex,
    # after "bytes_written" (where "crc32c" is for a CRC32C job)

Telemetry::

    {"agent": "dpu-0", "time": "...", "uptime_s": 12.5,
     "stats": {...},     # what the agent's telemetry source returned (`session_stats`)
     "events": {...}}    # the publisher's counters (`MqttEventPublisher.stats`)
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
    """The completion object of a finished job (see the module docstring)."""
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

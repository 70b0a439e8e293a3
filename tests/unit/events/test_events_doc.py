"""docs/events.md stays true: its field tables list exactly what the real code sends.

Every payload is built with `dpu_wire.events` (and its inputs with the agent's own
`SessionManager.telemetry` and `MqttEventPublisher.stats`); a field the code sends
that a table does not list fails, and so does a listed field the code never sends.
"""

import json
import re
import types
from pathlib import Path
from typing import Any, cast

import pytest

from dpu_agent.dataplane.jobs import JobRecord, Origin
from dpu_agent.dataplane.manager import ManagerSettings, SessionManager
from dpu_agent.dataplane.session import SessionState
from dpu_agent.events import MqttEventPublisher, MqttSettings
from dpu_wire import events as payloads
from dpu_wire.capsule import JobKind, Span, State

DOC = Path(__file__).resolve().parents[3] / "docs" / "events.md"
T0 = 1_700_000_000_123_456_789
_ROW = re.compile(r"^\| `([^`]+)` \|[^|]*\| ([^|]*) \|")


def documented(heading: str) -> dict[str, str]:
    """The fields of the table under `### {heading}`: name -> its "Present" cell."""
    text = DOC.read_text(encoding="utf-8")
    match = re.search(rf"^### {re.escape(heading)}\n(.*?)(?=^#)", text, re.MULTILINE | re.DOTALL)
    assert match is not None, f"docs/events.md has no '### {heading}' section"
    fields = {}
    for line in match.group(1).splitlines():
        row = _ROW.match(line)
        if row:
            fields[row.group(1)] = row.group(2).strip()
    assert fields, f"no field table under '### {heading}'"
    return fields


def check(heading: str, documents: list[dict[str, Any]]) -> None:
    """The keys of `documents` are the table's fields; "always" ones are in every one."""
    table = documented(heading)
    sent = set().union(*documents)
    assert sorted(sent - set(table)) == [], f"sent but not documented under '{heading}'"
    assert sorted(set(table) - sent) == [], f"documented under '{heading}' but never sent"
    for document in documents:
        missing = [name for name, present in table.items() if present == "always"]
        assert [name for name in missing if name not in document] == [], document


def finished(kind: JobKind, state: State, origin: Origin) -> JobRecord:
    job = JobRecord(
        2**63 + 1 if origin is Origin.GRPC else 7,
        kind,
        Span(0x1000, 4096, 1),
        Span(0x2000, 4096, 2),
        origin,
        0.0,
        request_id="key-1" if origin is Origin.GRPC else "",
        rpc_request_id="rid-1",
        submit_ns=T0,
    )
    if state != State.CANCELLED:
        job.start()
    job.result = 0x1234
    if kind == JobKind.SHA256 and state == State.SUCCEEDED:
        job.digest = bytes(range(32))
    assert job.finish(state, 0 if state == State.SUCCEEDED else 14, "")
    job.end_ns = T0 + 2_000
    return job


def completions() -> list[dict[str, Any]]:
    return [
        json.loads(payloads.completion_payload("s-1a2b3c", finished(kind, state, origin)))
        for kind in JobKind
        for state in (State.SUCCEEDED, State.FAILED, State.CANCELLED)
        for origin in Origin
    ]


def test_status_fields_are_documented():
    documents = [
        json.loads(payloads.status_payload("online", "dpu-0", "1.0", T0)),
        json.loads(payloads.status_payload("offline", "dpu-0", "1.0", T0, "shutdown")),
        json.loads(payloads.status_payload("offline", "dpu-0", "1.0", T0, "connection lost")),
    ]
    check("Status fields", documents)


def test_completion_fields_are_documented():
    check("Completion fields", completions())


def test_completion_status_fields_are_documented():
    check("Completion status fields", [d["status"] for d in completions()])


def telemetry_documents() -> list[dict[str, Any]]:
    def session(state):
        counters = types.SimpleNamespace(
            jobs_submitted=3, jobs_completed=2, jobs_failed=1, bytes_read=10, bytes_written=5
        )
        return types.SimpleNamespace(state=state, counters=counters, open_jobs=1)

    manager = SessionManager(ManagerSettings(), {}, reactor=cast("Any", None))
    publisher = MqttEventPublisher(MqttSettings(), "dpu-0")
    documents = []
    for sessions in (
        {},
        {"s-a": session(SessionState.ACTIVE), "s-b": session(SessionState.FAILED)},
    ):
        manager._sessions = cast("Any", sessions)
        payload = payloads.telemetry_payload(
            "dpu-0", T0, 1.5, manager.telemetry(), publisher.stats()
        )
        documents.append(json.loads(payload))
    return documents


def test_telemetry_fields_are_documented():
    documents = telemetry_documents()
    check("Telemetry fields", documents)
    check("Telemetry stats fields", [d["stats"] for d in documents])
    check("Telemetry events fields", [d["events"] for d in documents])


@pytest.mark.parametrize(
    "topic",
    [
        payloads.status_topic("{prefix}", "{agent}"),
        payloads.telemetry_topic("{prefix}", "{agent}"),
        payloads.completion_topic("{prefix}", "{agent}", "{tenant}", "{session}", 7).replace(
            "/jobs/7/", "/jobs/{job}/"
        ),
    ],
)
def test_topics_are_documented(topic):
    assert f"| `{topic}` |" in DOC.read_text(encoding="utf-8")

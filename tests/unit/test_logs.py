import io
import json
import logging

import pytest

from dpu_agent import logs, request_context


@pytest.fixture(autouse=True)
def restore_root_logger():
    root, access = logging.getLogger(), logging.getLogger(logs.ACCESS_LOGGER)
    handlers, level, filters = list(root.handlers), root.level, list(access.filters)
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    access.filters[:] = filters  # configure() put an access limit there


def test_json_lines_carry_request_id_and_extra_fields():
    stream = io.StringIO()
    logs.configure("info", "json", stream)
    token = request_context.request_id.set("rid-1")
    try:
        logging.getLogger("dpu_agent.test").info(
            "hello %s", "world", extra={"volume": "volumes/v1"}
        )
    finally:
        request_context.request_id.reset(token)
    entry = json.loads(stream.getvalue().splitlines()[-1])
    assert entry["msg"] == "hello world"
    assert entry["request_id"] == "rid-1"
    assert entry["volume"] == "volumes/v1"
    assert entry["level"] == "info"


def test_text_format_and_level_filter():
    stream = io.StringIO()
    logs.configure("warning", "text", stream)
    log = logging.getLogger("dpu_agent.test")
    log.info("hidden")
    log.warning("shown", extra={"k": 1})
    out = stream.getvalue()
    assert "hidden" not in out
    assert "shown k=1" in out


HOSTILE = [
    "evil\n2026-01-01 00:00:00,000 INFO    dpu_agent: forged line",
    "carriage\rreturn",
    "ansi \x1b[2J clear",
    "line\u2028separator and next\x85line",
    "spaced tenant=admin",
    'quote" k=v',
    "",
]


@pytest.mark.parametrize("fmt", logs.FORMATS)
@pytest.mark.parametrize("value", HOSTILE)
def test_a_client_chosen_value_cannot_forge_a_line_or_a_field(fmt, value):
    stream = io.StringIO()
    logs.configure("info", fmt, stream)
    token = request_context.request_id.set("rid-1")
    try:
        logging.getLogger("dpu_agent.test").info(
            "session opened %s", value, extra={"label": value, "tenant": "acme"}
        )
    finally:
        request_context.request_id.reset(token)
    text = stream.getvalue()
    assert text.endswith("\n")
    assert len(text.splitlines()) == 1, text  # splitlines() also splits at \r, \x85, \u2028
    assert not any(not c.isprintable() for c in text[:-1]), text
    line = text.splitlines()[0]
    if fmt == "json":
        entry = json.loads(line)
        assert entry["label"] == value
        assert entry["msg"] == f"session opened {value}"
        assert entry["tenant"] == "acme"
    else:
        fields = line.partition(" label=")[2]
        if fields.startswith('"'):  # quoted: a JSON string
            label, end = json.JSONDecoder().raw_decode(fields)
        else:
            label, end = fields.split(" ")[0], len(fields.split(" ")[0])
        assert label == value
        assert fields[end:] == " tenant=acme"


def test_text_tracebacks_are_indented_and_escaped():
    stream = io.StringIO()
    logs.configure("info", "text", stream)
    error = ValueError("bad label\n2026-01-01 00:00:00,000 INFO    forged")
    logging.getLogger("dpu_agent.test").error("failed", exc_info=error)
    first, *rest = stream.getvalue().splitlines()
    assert first.endswith("failed")
    assert rest
    assert all(line.startswith("  ") for line in rest)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _access(log: logging.Logger, tenant: str) -> None:
    log.info(logs.ACCESS_MESSAGE, extra={"method": "/dpu.v1.X/Y", "tenant": tenant, "code": "OK"})


def test_each_tenant_writes_at_most_its_access_lines_a_second():
    """A client calling fast wrote a line for every call, credentials or not (about
    250 bytes each, 1,000 calls a second from one client): the log's disk filled at
    the client's pace. Now a tenant writes `per_s` a second, a second's worth at once;
    the next line written counts what was dropped; other records are never dropped."""
    clock = _Clock()
    limit = logs.AccessLimit(100, clock)
    kept: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            kept.append(record)

    log = logging.getLogger("dpu_agent.test_access")
    log.propagate = False
    log.addHandler(Keep())
    log.addFilter(limit)
    log.setLevel(logging.INFO)
    for _ in range(250):
        _access(log, "a")
    assert len(kept) == 100  # the burst: a second's worth
    _access(log, "b")  # another tenant has its own
    log.warning("not an access line")
    assert len(kept) == 102
    clock.now += 0.5
    for _ in range(60):
        _access(log, "a")
    a_lines = [r for r in kept if getattr(r, "tenant", None) == "a"]
    assert len(a_lines) == 150
    assert getattr(a_lines[100], "dropped", 0) == 150  # the first line after the drops
    assert not hasattr(a_lines[101], "dropped")


def test_access_lines_are_limited_as_configured():
    stream = io.StringIO()
    logs.configure("info", "json", stream, access_per_s=3)
    log = logging.getLogger(logs.ACCESS_LOGGER)
    for _ in range(10):
        _access(log, "")
    assert len(stream.getvalue().splitlines()) == 3
    logs.configure("info", "json", stream, access_per_s=0)  # 0: every call, and no stale filter
    for _ in range(10):
        _access(log, "")
    assert len(stream.getvalue().splitlines()) == 13
    logs.configure("info", "json", stream)  # the default
    assert [f.per_s for f in log.filters if isinstance(f, logs.AccessLimit)] == [logs.ACCESS_PER_S]

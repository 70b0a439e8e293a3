import io
import json
import logging

import pytest

from dpu_agent import logs, request_context


@pytest.fixture(autouse=True)
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


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

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

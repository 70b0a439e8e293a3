"""gRPC core lines become agent records: handshake causes named, throttled; others pass."""

import io
import logging

import pytest

from dpu_agent import core_log

PLAINTEXT = (
    "I1123 20:28:41.993793   28127 ssl_transport_security.cc:2563] Handshake failed with error "
    "SSL_ERROR_SSL: error:100000f7:SSL routines:OPENSSL_internal:WRONG_VERSION_NUMBER: "
    "Invalid certificate verification context\n"
)
EXPIRED = (
    "I1123 20:28:42.312782   28126 ssl_transport_security.cc:2563] Handshake failed with error "
    "SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: "
    "certificate has expired\n"
)


@pytest.fixture
def reader():
    return core_log.CoreLogReader(io.StringIO())


def test_a_handshake_failure_is_one_warning_with_what_to_change(reader, caplog):
    with caplog.at_level(logging.DEBUG, logger="grpc.core"):
        reader.line(PLAINTEXT, now=100.0)
        reader.line(EXPIRED, now=100.0)
    messages = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert messages == [
        ("WARNING", "TLS handshake failed: " + core_log.HANDSHAKE_CAUSES[0][1]),
        ("WARNING", "TLS handshake failed: " + core_log.HANDSHAKE_CAUSES[1][1]),
    ]
    assert caplog.records[0].detail == (
        "WRONG_VERSION_NUMBER: Invalid certificate verification context"
    )


def test_a_flood_is_throttled_and_counted(reader, caplog):
    with caplog.at_level(logging.DEBUG, logger="grpc.core"):
        for i in range(1000):
            reader.line(PLAINTEXT, now=100.0 + i * 0.001)
        reader.line(PLAINTEXT, now=100.0 + core_log.THROTTLE_S)
    assert len(caplog.records) == 2
    assert caplog.records[1].similar_held_back == 999


def test_other_core_lines_keep_their_level_and_other_text_passes_through(caplog):
    out = io.StringIO()
    reader = core_log.CoreLogReader(out)
    with caplog.at_level(logging.DEBUG, logger="grpc.core"):
        reader.line("E1123 20:28:42.1 1 chttp2_server.cc:1]  bind failed\n")
        reader.line("I1123 20:28:42.1 1 something.cc:9] chatter\n")
        reader.line("tc: a child process's own complaint\n")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.ERROR, " bind failed"),
        (logging.DEBUG, "chatter"),
    ]
    assert out.getvalue() == "tc: a child process's own complaint\n"


def test_a_huge_line_is_cut(reader):
    out = io.StringIO()
    reader = core_log.CoreLogReader(out)
    reader.line("x" * 100_000 + "\n")
    assert len(out.getvalue()) == core_log.MAX_LINE + 1

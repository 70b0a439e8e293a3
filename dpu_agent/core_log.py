"""gRPC core's own log lines, turned into the agent's log records.

The gRPC C core writes to file descriptor 2 in its own format, e.g. for a client that
speaks plaintext to the mTLS port:

    I1123 20:28:41.99 28127 ssl_transport_security.cc:2563] Handshake failed with
    error SSL_ERROR_SSL: ...:WRONG_VERSION_NUMBER: Invalid certificate verification context

`capture()` points descriptor 2 at a pipe and reads it on a thread: a failed TLS
handshake becomes one warning that says what the client must change (at most one per
cause every `THROTTLE_S` seconds, with the count of those it held back, so a flood of
bad handshakes cannot flood the log); other core lines become records of the
"grpc.core" logger; anything else (a child process's stderr) passes through unchanged.
The agent's own records and faulthandler keep writing to the original stderr.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
import threading
import time
from typing import IO, Final

log = logging.getLogger("grpc.core")

# gRPC reads $GRPC_VERBOSITY when it is imported, and a failed handshake is an INFO
# line, which its default level writes: importing this module first (dpu_agent.cli
# does) drops an inherited ERROR or WARNING (e.g. the SDK's) that would hide it. DEBUG
# and INFO stay.
if "grpc" not in sys.modules and os.environ.get("GRPC_VERBOSITY", "").upper() not in (
    "DEBUG",
    "INFO",
):
    os.environ.pop("GRPC_VERBOSITY", None)

THROTTLE_S: Final = 10.0
MAX_LINE: Final = 4096
_CORE_LINE: Final = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+\d+ (\S+:\d+)\] (.*)$")
_LEVELS: Final = {
    "I": logging.DEBUG,
    "W": logging.WARNING,
    "E": logging.ERROR,
    "F": logging.CRITICAL,
}

# (what the core says, what the agent logs): the first that matches a handshake failure
HANDSHAKE_CAUSES: Final = (
    (
        "WRONG_VERSION_NUMBER",
        (
            "a client connected without TLS: this agent serves mTLS only; the client needs "
            "--ca, --cert and --key (or $DPU_TLS_CA, $DPU_TLS_CERT, $DPU_TLS_KEY)"
        ),
    ),
    (
        "certificate has expired",
        (
            "a client presented an expired certificate: it needs a new one "
            "(dpuctl certs client DIR TENANT)"
        ),
    ),
    (
        "CERTIFICATE_VERIFY_FAILED",
        (
            "a client presented a certificate not signed by this agent's client CA "
            "([tls] client_ca): it needs one from that CA"
        ),
    ),
    (
        "ALERT_UNKNOWN_CA",
        (
            "a client does not trust this agent's certificate: it needs the CA that signed "
            "it (--ca or $DPU_TLS_CA)"
        ),
    ),
    (
        "PEER_DID_NOT_RETURN_A_CERTIFICATE",
        "a client connected without a client certificate: it needs --cert and --key",
    ),
    (
        "",
        (
            "a client's TLS handshake failed: it needs the CA that signed this agent's "
            "certificate (--ca) and a client certificate from [tls] client_ca"
        ),
    ),
)


@dataclasses.dataclass
class _Throttle:
    last: float = -THROTTLE_S
    held: int = 0


class CoreLogReader:
    """Reads gRPC core lines from a pipe and logs them as the agent's records."""

    def __init__(self, passthrough: IO[str]) -> None:
        self._passthrough = passthrough
        self._throttles: dict[str, _Throttle] = {}

    def line(self, text: str, now: float | None = None) -> None:
        """Handle one line of what was written to descriptor 2."""
        text = text.rstrip("\n")[:MAX_LINE]
        match = _CORE_LINE.match(text)
        if match is None:
            if text:
                self._passthrough.write(text + "\n")
                self._passthrough.flush()
            return
        level, where, message = match.groups()
        if "Handshake failed" in message:
            self._handshake(message, time.monotonic() if now is None else now)
            return
        log.log(_LEVELS[level], "%s", message, extra={"source": where})

    def _handshake(self, message: str, now: float) -> None:
        cause = next(text for key, text in HANDSHAKE_CAUSES if key in message)
        throttle = self._throttles.setdefault(cause, _Throttle())
        if now - throttle.last < THROTTLE_S:
            throttle.held += 1
            return
        held, throttle.held, throttle.last = throttle.held, 0, now
        detail = message.rsplit("SSL routines:", 1)[-1].removeprefix("OPENSSL_internal:")
        log.warning(
            "TLS handshake failed: %s",
            cause,
            extra={"detail": detail, **({"similar_held_back": held} if held else {})},
        )

    def run(self, stream: IO[str]) -> None:
        """Read `stream` to its end."""
        for text in stream:
            try:
                self.line(text)
            except Exception:  # noqa: BLE001 - the reader must outlive one bad line
                self._passthrough.write(text)


def capture() -> None:
    """Send descriptor 2 through a `CoreLogReader`; `sys.stderr` keeps the real stderr.

    Call it before the log handlers are configured (they write to `sys.stderr`).
    """
    original = os.dup(2)
    sys.stderr.flush()
    sys.stderr = os.fdopen(original, "w", buffering=1, encoding="utf-8", errors="replace")
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    reader = CoreLogReader(sys.stderr)
    stream = os.fdopen(read_end, encoding="utf-8", errors="replace")
    threading.Thread(target=reader.run, args=(stream,), name="grpc-core-log", daemon=True).start()

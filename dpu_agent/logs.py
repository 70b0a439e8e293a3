"""Structured logging for the agent process.

Library modules only create loggers (`logging.getLogger(__name__)`); the process
entry point calls `configure()` once. JSON lines carry the request id of the RPC
being served, and any `extra={...}` fields given at the call site.

Logged values often come from clients (labels, request ids, names). Neither format
lets one forge a line or a field. JSON escapes every control and non-ASCII character
itself. The text format escapes non-printable characters (newline, carriage return,
ANSI escapes, U+2028...) in the message (`printable`), writes a field value that holds
one, a space, a quote or "=" as a JSON string (`label="a b"`), so `k=v` pairs stay
unambiguous, and indents a traceback's lines, so only a record's first line starts at
column 0.

Every RPC writes one access-log line ("rpc", from the interceptor), so a client that
calls fast would fill the disk the logs go to; credentials are not needed for a call
that is refused. `AccessLimit` lets each tenant (the unauthenticated calls count as
one, "") write `[log] access_per_s` of them a second, a second's worth in a burst;
the lines past that are dropped, and the tenant's next line written says how many
(`dropped`). Other records are never dropped.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from typing import TYPE_CHECKING, Final, TextIO

from dpu_agent import request_context

if TYPE_CHECKING:
    from collections.abc import Callable

LEVELS: Final = ("debug", "info", "warning", "error")
FORMATS: Final = ("json", "text")
ACCESS_LOGGER: Final = "dpu_agent.interceptor"  # whose "rpc" records are access-log lines
ACCESS_MESSAGE: Final = "rpc"
ACCESS_PER_S: Final = 100  # [log] access_per_s's default

# Attributes every LogRecord has; anything else came in through `extra=`.
_STANDARD_ATTRS: Final = frozenset(
    logging.LogRecord("", 0, "", 0, "", (), None).__dict__.keys() | {"message", "asctime"}
)


_QUOTED: Final = frozenset(' "=\\')


def printable(text: str) -> str:
    """`text` with each non-printable character escaped as Python writes it: one line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)


def _escape(char: str) -> str:
    return char.encode("unicode_escape").decode("ascii")


def _field_value(value: object) -> str:
    """A field's value as is, or as a JSON string if it is empty or could break the line."""
    text = str(value)
    if text and text.isprintable() and not any(c in text for c in _QUOTED):
        return text
    return json.dumps(text)  # ASCII only: every other character as a JSON escape


def _context_fields(record: logging.LogRecord) -> dict[str, object]:
    """The request id of the RPC being served plus the fields given with `extra=`."""
    fields: dict[str, object] = {}
    rid = request_context.request_id.get()
    if rid:
        fields["request_id"] = rid
    fields.update(
        (k, v) for k, v in record.__dict__.items() if k not in _STANDARD_ATTRS and k[0] != "_"
    )
    return fields


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, request_id, extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        """Render the record as a JSON line."""
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(_context_fields(record))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """Human-readable lines with the request id and extra fields appended."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        """The prefix and the message, with the message's control characters escaped."""
        record.message = printable(record.message)
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        """Render the record as one readable line (a traceback follows on its own lines)."""
        tail = []
        if record.exc_info:
            tail.append(self.formatException(record.exc_info))
        if record.stack_info:
            tail.append(self.formatStack(record.stack_info))
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        try:
            line = super().format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved
        fields = _context_fields(record)
        if fields:
            line += " " + " ".join(f"{printable(k)}={_field_value(v)}" for k, v in fields.items())
        # a traceback keeps its lines, each indented: no line of it starts a record
        indented = ("  " + printable(part) for text in tail for part in text.splitlines())
        return "\n".join([line, *indented])


class AccessLimit(logging.Filter):
    """At most `per_s` access-log lines a second per tenant (see the module docstring)."""

    def __init__(self, per_s: int, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.per_s = per_s
        self._clock = clock
        self._tenants: dict[str, list[float]] = {}  # tenant -> [tokens, when, dropped]
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether to write the record; an access line written says what was dropped."""
        if record.msg != ACCESS_MESSAGE:
            return True
        tenant = str(getattr(record, "tenant", ""))
        with self._lock:
            now = self._clock()
            state = self._tenants.get(tenant)
            if state is None:
                state = self._tenants[tenant] = [float(self.per_s), now, 0]
            tokens = min(float(self.per_s), state[0] + (now - state[1]) * self.per_s)
            state[1] = now
            if tokens < 1:
                state[0] = tokens
                state[2] += 1
                return False
            state[0] = tokens - 1
            dropped, state[2] = int(state[2]), 0
        if dropped:
            record.dropped = dropped
        return True


def configure(
    level: str = "info",
    fmt: str = "json",
    stream: TextIO | None = None,
    access_per_s: int = ACCESS_PER_S,
) -> None:
    """Configure the root logger once for the agent process (`access_per_s` 0: no limit)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    access = logging.getLogger(ACCESS_LOGGER)
    for old_filter in [f for f in access.filters if isinstance(f, AccessLimit)]:
        access.removeFilter(old_filter)
    if access_per_s:
        access.addFilter(AccessLimit(access_per_s))

"""Structured logging for the agent process.

Library modules only create loggers (`logging.getLogger(__name__)`); the process
entry point calls `configure()` once. JSON lines carry the request id of the RPC
being served, and any `extra={...}` fields given at the call site.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Final, TextIO

from dpu_agent import request_context

LEVELS: Final = ("debug", "info", "warning", "error")
FORMATS: Final = ("json", "text")

# Attributes every LogRecord has; anything else came in through `extra=`.
_STANDARD_ATTRS: Final = frozenset(
    logging.LogRecord("", 0, "", 0, "", (), None).__dict__.keys() | {"message", "asctime"}
)


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

    def format(self, record: logging.LogRecord) -> str:
        """Render the record as one readable line."""
        line = super().format(record)
        fields = _context_fields(record)
        if fields:
            line += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        return line


def configure(level: str = "info", fmt: str = "json", stream: TextIO | None = None) -> None:
    """Configure the root logger once for the agent process."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())

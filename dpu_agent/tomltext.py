"""TOML documents the agent reads (its configuration, the tokens file), parsed safely.

`tomllib` parses nested arrays and inline tables recursively, so a deeply nested
document raises RecursionError (a 3,000-line traceback) instead of TOMLDecodeError.
Both become one `TomlError` whose message is one line.
"""

from __future__ import annotations

import tomllib
from typing import Any


class TomlError(ValueError):
    """The text is not a TOML document this agent accepts; the message says why."""


def loads(text: str) -> dict[str, Any]:
    """The document in `text`; TomlError if it is malformed or nested too deeply."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TomlError(f"invalid TOML: {exc}") from None
    except RecursionError:
        raise TomlError("invalid TOML: arrays or tables nested too deeply") from None

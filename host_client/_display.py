"""Agent-supplied text as dpuctl shows it to a person: nothing a terminal acts on.

Names, labels and messages come from the agent, and an agent may be hostile or
compromised. Printed raw, a name could carry terminal escapes (set the window
title, clear the screen, paint a fake "all good"). Every human-readable output
path of dpuctl passes such text through `printable`. JSON output needs nothing:
`json.dumps` and `MessageToJson` escape control characters. An enum number this
client's protos do not name (a newer agent's, or a hostile one's) made `Name()`
raise and dpuctl end in a traceback; `enum_name` shows it as UNKNOWN(77).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from collections.abc import Callable

_V = TypeVar("_V", bound=int)


def printable(text: str) -> str:
    r"""`text` with every non-printable character escaped as repr does (\x1b, \n, \u202e).

    Non-printable is Python's `str.isprintable`: control characters (C0, DEL, C1, so
    ESC and CSI), format characters such as bidi overrides, line and paragraph
    separators. Letters of any script and the space stay as they are; so does a
    backslash (the text may hold a repr already; a backslash moves no cursor).
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def enum_name(name_of: Callable[[_V], str], value: _V, prefix: str = "") -> str:
    """The enum value's name without `prefix`, e.g. `enum_name(PortKind.Name, 1, "PORT_KIND_")`.

    A number this client's protos do not name (a newer or a hostile agent) is
    "UNKNOWN(77)" instead of the ValueError of `Name()`.
    """
    try:
        return name_of(value).removeprefix(prefix)
    except ValueError:
        return f"UNKNOWN({int(value)})"

"""Resource-name grammar of the dpu.v1 API (AIP-122 style).

A resource name is a sequence of `collection/id` pairs, e.g. `volumes/vol-1` or
`sessions/s-1/regions/in`. IDs are lowercase DNS labels: letters, digits and
hyphens, 1-63 characters, starting and ending with a letter or digit. A numeric id
(a job's) is also in canonical decimal, so each resource has exactly one name:
`sessions/s-1/jobs/7`, never `.../jobs/07`.
"""

from __future__ import annotations

import re

MAX_ID_LENGTH = 63
MAX_NAME_LENGTH = 256

ID_PATTERN = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_ID_RE = re.compile(ID_PATTERN)
_NUMBER_RE = re.compile(r"0|[1-9][0-9]*")
U64_MAX = (1 << 64) - 1


class InvalidNameError(ValueError):
    """A resource name or id does not follow the grammar."""


def check_id(value: str, what: str = "id") -> str:
    """Return `value` if it is a valid resource id, else raise InvalidNameError."""
    if not value:
        raise InvalidNameError(f"{what} is empty")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidNameError(f"{what} is {len(value)} characters long (at most {MAX_ID_LENGTH})")
    if not _ID_RE.fullmatch(value):
        raise InvalidNameError(
            f"{what} {value!r} is not a lowercase DNS label "
            "(letters, digits and '-', starting and ending with a letter or digit)"
        )
    return value


def parse_number(value: str, what: str = "id", maximum: int = U64_MAX) -> int:
    """A numeric id in canonical decimal (no sign, spaces or leading zeros), 0..`maximum`."""
    if not _NUMBER_RE.fullmatch(value) or len(value) > len(str(maximum)):
        raise InvalidNameError(
            f"{what} {value[:MAX_ID_LENGTH]!r} is not a number in canonical decimal "
            "(digits without leading zeros)"
        )
    number = int(value)
    if number > maximum:
        raise InvalidNameError(f"{what} {value} is larger than {maximum}")
    return number


def parse_name(value: str, *collections: str) -> tuple[str, ...]:
    """Split a resource name into its ids, checking it has the given collections.

    `parse_name("sessions/s1/jobs/7", "sessions", "jobs")` returns `("s1", "7")`.
    """
    pattern = "/".join(f"{c}/{{id}}" for c in collections)
    if not value:
        raise InvalidNameError(f"name is empty (expected {pattern!r})")
    if len(value) > MAX_NAME_LENGTH:
        raise InvalidNameError(f"name is {len(value)} characters long (at most {MAX_NAME_LENGTH})")
    parts = value.split("/")
    if len(parts) != 2 * len(collections) or parts[0::2] != list(collections):
        raise InvalidNameError(f"name {value!r} does not match {pattern!r}")
    ids = tuple(parts[1::2])
    for collection, ident in zip(collections, ids, strict=True):
        check_id(ident, f"{collection} id")
    return ids


def format_name(*pairs: str) -> str:
    """Join collection/id pairs: `format_name("volumes", "v1")` is `"volumes/v1"`."""
    return "/".join(pairs)

"""Request ids: the `x-request-id` every call carries to the agent.

The agent logs each call with its request id, echoes it in the trailing metadata,
and puts the id of the SubmitJob (or, for capsule jobs, of the session's
OpenSession) into the job's completion event on MQTT. The SDK makes a new id for
each call unless the caller chose one:

    with host_client.request_id("order-42"):       # every call in the block
        session = await client.open_session()      # ... and the tasks it starts
    await session.submit_rpc("crc32c", buf, request_id="order-42-crc")  # one call
"""

from __future__ import annotations

import contextlib
import contextvars
import uuid
from typing import TYPE_CHECKING, Final

from host_client._errors import InvalidArgumentError

if TYPE_CHECKING:
    from collections.abc import Iterator

MAX_LENGTH: Final = 128  # the agent keeps at most this many characters

_current: contextvars.ContextVar[str] = contextvars.ContextVar("dpu_request_id", default="")


def check(value: str) -> str:
    """Return `value` if it can be a request id: 1-128 printable ASCII characters."""
    if not 0 < len(value) <= MAX_LENGTH or not value.isascii() or not value.isprintable():
        raise InvalidArgumentError(
            "INVALID_ARGUMENT",
            f"a request id is 1-{MAX_LENGTH} printable ASCII characters, not {value!r}",
        )
    return value


@contextlib.contextmanager
def request_id(value: str) -> Iterator[str]:
    """Send `value` as the request id of every call made inside the block.

    It follows the context: tasks started inside the block (such as a session's
    completion watcher) keep it. A `request_id=` argument of a call wins over it.
    """
    token = _current.set(check(value))
    try:
        yield value
    finally:
        _current.reset(token)


def current() -> str:
    """The request id set by an enclosing `request_id` block, or ""."""
    return _current.get()


def for_call(explicit: str | None = None) -> str:
    """The id a call sends: `explicit`, else the enclosing block's, else a new one."""
    if explicit:
        return check(explicit)
    return _current.get() or uuid.uuid4().hex

"""One way to page a list for every List RPC (AIP-158).

Items are ordered by a string key; a page token is the last key of the previous page,
base64-encoded so callers treat it as opaque. Page sizes: 0 means the default,
larger than the maximum is capped, negative is refused earlier by validation.
"""

from __future__ import annotations

import base64
import binascii
from typing import TYPE_CHECKING, Final, TypeVar

from dpu_agent.errors import InvalidArgument

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

DEFAULT_PAGE_SIZE: Final = 100
MAX_PAGE_SIZE: Final = 500

_T = TypeVar("_T")


def page(
    items: Iterable[_T], key: Callable[[_T], str], page_size: int, page_token: str
) -> tuple[list[_T], str]:
    """The page after `page_token`, in key order, and the next page's token ("" at the end)."""
    after = _decode(page_token)
    later = sorted((item for item in items if key(item) > after), key=key)
    size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
    chunk = later[:size]
    token = _encode(key(chunk[-1])) if len(later) > size else ""
    return chunk, token


def _encode(last_key: str) -> str:
    return base64.urlsafe_b64encode(last_key.encode()).decode()


def _decode(token: str) -> str:
    if not token:
        return ""
    try:
        return base64.b64decode(token.encode(), altchars=b"-_", validate=True).decode()
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise InvalidArgument("page_token is not one this agent issued") from None

"""One way to page a list for every List RPC (AIP-158).

Items are ordered by a string key. A page token is opaque to callers: base64 of a
format byte, a digest of the request it continues and the last key of the previous
page. The digest covers the request's type (so the method) and every field but
page_size and page_token (so the parent and the filters): a token used with another
List method, another parent (ListJobs of another session) or another filter is
refused INVALID_ARGUMENT, as AIP-158 asks, instead of paging some other list from
the middle. The page size may change from page to page. Page sizes: 0 means the
default, larger than the maximum is capped, negative is refused earlier by validation.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from typing import TYPE_CHECKING, Final, TypeVar

from dpu_agent.errors import InvalidArgument

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from google.protobuf.message import Message

DEFAULT_PAGE_SIZE: Final = 100
MAX_PAGE_SIZE: Final = 500

_FORMAT: Final = b"\x01"  # the first byte of a decoded token: this layout
_DIGEST_BYTES: Final = 12
_PAGING_FIELDS: Final = ("page_size", "page_token")

_T = TypeVar("_T")


def page(items: Iterable[_T], key: Callable[[_T], str], request: Message) -> tuple[list[_T], str]:
    """The page of `request` (a List request), in key order, and the next page's token.

    `request` has `page_size` and `page_token`; the next page's token is "" at the end.
    """
    size, token = _paging_fields(request)
    binding = _binding(request)
    after = _decode(token, binding)
    later = sorted((item for item in items if key(item) > after), key=key)
    size = min(size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
    chunk = later[:size]
    next_token = _encode(binding, key(chunk[-1])) if len(later) > size else ""
    return chunk, next_token


def _paging_fields(request: Message) -> tuple[int, str]:
    fields = request.DESCRIPTOR.fields_by_name
    if any(name not in fields for name in _PAGING_FIELDS):
        raise TypeError(f"{request.DESCRIPTOR.full_name} has no page_size and page_token")
    # any List request: its class is not known here
    return int(getattr(request, "page_size")), str(getattr(request, "page_token"))  # noqa: B009


def _binding(request: Message) -> bytes:
    """A digest of the request type and every field but the paging ones."""
    scope = type(request)()
    scope.CopyFrom(request)
    for name in _PAGING_FIELDS:
        scope.ClearField(name)
    digest = hashlib.sha256(request.DESCRIPTOR.full_name.encode() + b"\0")
    digest.update(scope.SerializeToString(deterministic=True))
    return digest.digest()[:_DIGEST_BYTES]


def _encode(binding: bytes, last_key: str) -> str:
    return base64.urlsafe_b64encode(_FORMAT + binding + last_key.encode()).decode()


def _decode(token: str, binding: bytes) -> str:
    if not token:
        return ""
    try:
        raw = base64.b64decode(token.encode(), altchars=b"-_", validate=True)
        last_key = raw[1 + _DIGEST_BYTES :].decode()
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise InvalidArgument("page_token is not one this agent issued") from None
    if raw[:1] != _FORMAT or len(raw) <= 1 + _DIGEST_BYTES:
        raise InvalidArgument("page_token is not one this agent issued")
    if raw[1 : 1 + _DIGEST_BYTES] != binding:
        raise InvalidArgument(
            "page_token belongs to another request: a token continues only the List call "
            "that returned it, with the same parent and filters (only page_size may change)"
        )
    return last_key

"""Idempotent retries: a mutating call retried with its request_id gets the first answer.

common.proto promises it for every mutating call (every request with a `request_id`
field). Two kinds keep their own record, tied to the lifetime of what they made:
OpenSession (docs/data-plane.md DP-1.1-4: the same session while it exists) and
SubmitJob (the same job while its session keeps it). Every other one is answered here,
by the interceptor, before its service runs:

- the first successful reply of (tenant, method, request_id) is kept, and a retry gets
  that reply again without the service acting a second time;
- a retry that arrives while the first call still runs waits for it and gets its answer,
  an error included;
- a call that failed keeps nothing: it changed nothing, so its retry acts;
- a request_id is one request's: a call with the key of a kept (or running) call whose
  request differs (`request_digest`, over its whole message) is refused
  INVALID_ARGUMENT and changes nothing, rather than answered with the other request's
  reply as if it had been done (AIP-155).

What another tenant sends never touches a tenant's replies: each tenant has its own
book of at most `MAX_PER_TENANT` replies and `MAX_BYTES_PER_TENANT` bytes of them, the
oldest forgotten first, each kept for `TTL_S`. All books together hold at most
`MAX_BYTES` (the least recently used book goes first), so the memory this takes is
bounded whatever the callers do. A retry that comes after its reply was forgotten acts
again (a retried delete then answers NOT_FOUND).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import time
from typing import TYPE_CHECKING, Any, Final, TypeAlias

from google.protobuf.message import Message

from dpu_agent.errors import InvalidArgument

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

MAX_PER_TENANT: Final = 1024
MAX_BYTES_PER_TENANT: Final = 1 << 20
MAX_BYTES: Final = 32 << 20
TTL_S: Final = 300.0
Digest: TypeAlias = bytes  # `request_digest`'s (a name: Replies has a `bytes` property)
OWN_RECORD: Final = frozenset(
    {"/dpu.v1.SessionService/OpenSession", "/dpu.v1.JobService/SubmitJob"}
)


class _Again(Exception):
    """The first call was cancelled before it answered: the waiting retry runs itself."""


class _Entry:
    __slots__ = ("digest", "expires", "future", "size")

    def __init__(self, future: asyncio.Future[Any], expires: float, digest: bytes) -> None:
        self.future = future
        self.expires = expires
        self.digest = digest  # of the request that made it
        self.size = 0  # the reply's bytes, once there is one


class _Book:
    """One tenant's replies, oldest first."""

    __slots__ = ("bytes", "entries")

    def __init__(self) -> None:
        self.entries: collections.OrderedDict[tuple[str, str], _Entry] = collections.OrderedDict()
        self.bytes = 0

    def drop(self, key: tuple[str, str], entry: _Entry) -> None:
        if self.entries.get(key) is entry:
            del self.entries[key]
            self.bytes -= entry.size

    def trim(self) -> None:
        """Forget the oldest replies past the bounds."""
        while self.entries and (
            len(self.entries) > MAX_PER_TENANT or self.bytes > MAX_BYTES_PER_TENANT
        ):
            _, entry = self.entries.popitem(last=False)
            self.bytes -= entry.size


def request_id_of(method: str, request: object) -> str:
    """The request's idempotency key if this module answers its retries, else ""."""
    if method in OWN_RECORD or not isinstance(request, Message):
        return ""
    if "request_id" not in request.DESCRIPTOR.fields_by_name:
        return ""
    key: str = getattr(request, "request_id", "")
    return key


def request_digest(request: object) -> bytes:
    """What tells two requests apart: a hash of the whole message (b"" for a non-message)."""
    if not isinstance(request, Message):
        return b""
    data = request.SerializeToString(deterministic=True)
    return hashlib.blake2b(data, digest_size=16).digest()


class Replies:
    """The kept replies of every tenant (used on the server's event loop only)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._books: collections.OrderedDict[str, _Book] = collections.OrderedDict()

    def __len__(self) -> int:
        return sum(len(book.entries) for book in self._books.values())

    @property
    def bytes(self) -> int:
        """Of every reply kept."""
        return sum(book.bytes for book in self._books.values())

    def _book(self, tenant: str) -> _Book:
        book = self._books.get(tenant)
        if book is None:
            book = self._books[tenant] = _Book()
        else:
            self._books.move_to_end(tenant)
        return book

    def _drop_if_empty(self, tenant: str, book: _Book) -> None:
        if not book.entries and self._books.get(tenant) is book:
            del self._books[tenant]

    def _keep(self, tenant: str, book: _Book, entry: _Entry, reply: object) -> None:
        """Count the reply's bytes; forget the oldest past the bounds."""
        entry.size = reply.ByteSize() if isinstance(reply, Message) else 0
        book.bytes += entry.size
        book.trim()
        total = self.bytes
        while total > MAX_BYTES and self._books:
            oldest, dropped = next(iter(self._books.items()))
            if dropped is book and len(self._books) == 1:
                break  # within its own bound already
            del self._books[oldest]
            total -= dropped.bytes
        self._drop_if_empty(tenant, book)

    async def call(
        self,
        tenant: str,
        method: str,
        request_id: str,
        run: Callable[[], Awaitable[Any]],
        digest: Digest = b"",
    ) -> Any:  # noqa: ANN401 - the method's reply
        """`run()`'s reply, or the reply the first call with this key got.

        `digest` (`request_digest`) tells this call's request from the first one's: a
        different one is refused InvalidArgument.
        """
        key = (method, request_id)
        while True:
            book = self._book(tenant)
            entry = book.entries.get(key)
            if entry is None:
                break
            if entry.expires <= self._clock() and entry.future.done():
                book.drop(key, entry)
                break
            if entry.digest != digest:
                self._drop_if_empty(tenant, book)
                name = method.rsplit("/", 1)[-1]
                raise InvalidArgument(
                    f"request_id {request_id!r} was used for another {name} request: "
                    "give each distinct request its own"
                )
            try:
                return await asyncio.shield(entry.future)
            except _Again:
                continue
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        entry = book.entries[key] = _Entry(future, self._clock() + TTL_S, digest)
        try:
            reply = await run()
        except BaseException as exc:
            book.drop(key, entry)
            self._drop_if_empty(tenant, book)
            future.set_exception(exc if isinstance(exc, Exception) else _Again())
            future.exception()  # retrieved: no "never retrieved" warning without waiters
            raise
        future.set_result(reply)
        if book.entries.get(key) is entry:
            self._keep(tenant, book, entry, reply)
        return reply

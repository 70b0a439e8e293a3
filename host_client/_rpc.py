"""The SDK's one way to make a call: typed stubs, the per-call deadline, request ids, errors.

`Client` opens the channel and makes an `Rpc` over it; a `Session` gets the same
`Rpc`, so sessions make their calls without reaching into the client.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar

import grpc
from grpc_health.v1 import health_pb2_grpc

from dpu_wire import REQUEST_ID_METADATA_KEY
from dpu_wire.v1 import (
    agent_pb2_grpc,
    job_pb2_grpc,
    network_pb2_grpc,
    session_pb2_grpc,
    storage_pb2_grpc,
    virtualization_pb2_grpc,
)
from host_client._diagnose import is_connect_failure
from host_client._errors import DpuError, InternalError, UnavailableError, from_rpc_error
from host_client._request_ids import for_call

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterable

MAX_PAGES: Final = 10_000
"""The most pages `Rpc.all_pages` asks for: 1,000,000 items at the default 100 a page."""
MAX_ITEMS: Final = 1_000_000
"""The most items `Rpc.all_pages` keeps (a hostile agent's pages of 500)."""

_R = TypeVar("_R")
_T = TypeVar("_T")


class _Page(Protocol):
    """A List RPC's answer (AIP-158): one page and the token of the next."""

    next_page_token: str


_P = TypeVar("_P", bound=_Page)


@dataclasses.dataclass(frozen=True)
class Stubs:
    """Typed gRPC stubs of every dpu.v1 service, for calls the SDK does not wrap yet."""

    agent: agent_pb2_grpc.AgentServiceAsyncStub
    sessions: session_pb2_grpc.SessionServiceAsyncStub
    jobs: job_pb2_grpc.JobServiceAsyncStub
    storage: storage_pb2_grpc.StorageServiceAsyncStub
    network: network_pb2_grpc.NetworkServiceAsyncStub
    virtualization: virtualization_pb2_grpc.VirtualizationServiceAsyncStub
    health: health_pb2_grpc.HealthStub

    @classmethod
    def over(cls, channel: grpc.aio.Channel) -> Stubs:
        """Stubs over an open channel."""
        ch: Any = channel
        return cls(
            agent=agent_pb2_grpc.AgentServiceStub(ch),
            sessions=session_pb2_grpc.SessionServiceStub(ch),
            jobs=job_pb2_grpc.JobServiceStub(ch),
            storage=storage_pb2_grpc.StorageServiceStub(ch),
            network=network_pb2_grpc.NetworkServiceStub(ch),
            virtualization=virtualization_pb2_grpc.VirtualizationServiceStub(ch),
            health=health_pb2_grpc.HealthStub(ch),
        )


class Rpc:
    """Calls on one channel: each with the deadline, a request id, and DpuError on failure.

    `explain`, if given, is asked why the channel could not connect when a call fails
    that way; its one line (what to change) replaces gRPC's generic message.
    """

    def __init__(
        self,
        stubs: Stubs,
        timeout: float | None,
        explain: Callable[[], Awaitable[str | None]] | None = None,
    ) -> None:
        self.stubs = stubs
        self.timeout = timeout
        self._explain = explain

    async def error(self, exc: grpc.aio.AioRpcError, request_id: str) -> DpuError:
        """The DpuError of a failed call; a failure to connect says why, if it can be told."""
        error = from_rpc_error(exc, request_id)
        if (
            self._explain is not None
            and exc.code() == grpc.StatusCode.UNAVAILABLE
            and is_connect_failure(exc.details() or "")
        ):
            reason = await self._explain()
            if reason is not None:
                return UnavailableError("UNAVAILABLE", reason, error.request_id)
        return error

    async def call(
        self,
        method: Callable[..., Awaitable[_R]],
        request: object,
        *,
        request_id: str | None = None,
    ) -> _R:
        """Call `method` with `request`; raise the matching DpuError if it fails."""
        rid = for_call(request_id)
        try:
            return await method(
                request, timeout=self.timeout, metadata=((REQUEST_ID_METADATA_KEY, rid),)
            )
        except grpc.aio.AioRpcError as exc:
            raise await self.error(exc, rid) from None

    async def all_pages(
        self,
        method: Callable[..., Awaitable[_P]],
        request: Callable[[str], object],
        items: Callable[[_P], Iterable[_T]],
    ) -> list[_T]:
        """Every item of a paged List RPC: one call per page until the last.

        The agent decides when the listing ends (an empty next_page_token), so a
        faulty or hostile one could page forever and grow the list without end. A
        page token seen before (the listing would go round) raises InternalError at
        once; so do more than MAX_PAGES pages or MAX_ITEMS items. An agent answers at
        most 500 items a page (100 when, as here, no page size is asked), so the
        bounds let through any listing of up to a million items at the default page
        size, far above what one agent holds (a few thousand sessions, volumes or
        rules; 65,535 rule priorities a port).
        """
        found: list[_T] = []
        seen: set[bytes] = set()  # digests: a hostile token may be megabytes long
        token = ""
        for _ in range(MAX_PAGES):
            page = await self.call(method, request(token))
            found.extend(items(page))
            if len(found) > MAX_ITEMS:
                raise InternalError(
                    "INTERNAL", f"the agent's listing goes on past {MAX_ITEMS:,} items"
                )
            token = page.next_page_token
            if not token:
                return found
            digest = hashlib.sha256(token.encode()).digest()
            if digest in seen:
                raise InternalError(
                    "INTERNAL",
                    f"the agent's listing does not end: it answered page token "
                    f"{token[:40]!r} twice (after {len(found):,} items)",
                )
            seen.add(digest)
        raise InternalError("INTERNAL", f"the agent's listing goes on past {MAX_PAGES:,} pages")

"""All sessions of the agent: open, find, list, close, and reap the orphaned ones.

A session stays alive while its host watches it (a WatchCompletions stream, which
the SDK opens right after OpenSession and keeps open for the session's life). When
the last stream ends (host gone, network cut) and none comes back within
`orphan_timeout`, the session is closed: its queue pair is destroyed and its regions
forgotten. A session that no stream ever watched lives `first_watch_timeout` (or
`orphan_timeout` if that is shorter), so a client cannot hold slots by opening
sessions it never uses.

Each session belongs to the tenant that opened it; the services check ownership
(`dpu_agent.auth`). Admission bounds, so no one client or tenant takes every slot:
`max_sessions` for the agent, `Quotas.max_sessions` per tenant (16 by default) and
`Quotas.max_queue_depth` for the sum of a tenant's queue depths (jobs in flight), and
`max_sessions_per_connection` per client connection (the gRPC peer: one channel, so
two programs of one tenant, or one program's two channels, count apart). Sessions
being connected count, so concurrent opens cannot slip past a limit.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import secrets
import time
from typing import TYPE_CHECKING, Final

from dpu_agent import paging
from dpu_agent.dataplane.session import Session, SessionSettings, SessionState
from dpu_agent.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from dpu_agent.quota import Quotas
from dpu_wire import names
from dpu_wire.transport.base import TcpAddress, TransportError, VerbsAddress
from dpu_wire.v1 import agent_pb2

if TYPE_CHECKING:
    from collections.abc import Callable

    from dpu_agent.dataplane.jobs import JobRecord
    from dpu_agent.metrics import AgentMetrics
    from dpu_agent.storage import VolumeStore
    from dpu_wire.transport.base import AgentTransport, PeerAddress

log = logging.getLogger(__name__)

TRANSPORT_VERBS: Final = int(agent_pb2.TRANSPORT_VERBS)
TRANSPORT_TCP: Final = int(agent_pb2.TRANSPORT_TCP)
MAX_REMEMBERED_OPENS: Final = 4096  # request ids kept for idempotent OpenSession


@dataclasses.dataclass(frozen=True)
class ManagerSettings:
    """Limits of the session manager."""

    max_sessions: int = 64
    max_sessions_per_connection: int = 8
    max_queue_depth: int = 1024
    default_queue_depth: int = 32
    orphan_timeout: float = 10.0  # after the last watcher left
    first_watch_timeout: float = 5.0  # for a session no watcher ever came to
    chunk_size: int = 1 << 20
    default_deadline: float = 60.0


@dataclasses.dataclass(frozen=True)
class _Admitted:
    """What the manager keeps about how a session came in."""

    connection: str  # the gRPC peer that opened it
    unwatched_at_open: float | None  # Session.unwatched_since then; equal: never watched


class SessionManager:
    """Owns every session; the gRPC services are thin layers over it."""

    def __init__(  # noqa: PLR0913 - the manager's parts, metrics by keyword
        self,
        settings: ManagerSettings,
        transports: dict[int, Callable[[int], AgentTransport]],
        on_completion: Callable[[Session, JobRecord], None] | None = None,
        store: VolumeStore | None = None,
        quotas: Quotas | None = None,
        *,
        metrics: AgentMetrics | None = None,
    ) -> None:
        self.settings = settings
        self._store = store
        self._metrics = metrics
        self._transports = transports
        self._on_completion = on_completion
        self._quotas = quotas or Quotas()
        self._sessions: dict[str, Session] = {}
        # (tenant, request_id) -> session id, for idempotent open; oldest forgotten first
        self._by_request: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()
        # (tenant, queue depth, connection) of the sessions being opened
        self._connecting: list[tuple[str, int, str]] = []
        self._admitted: dict[str, _Admitted] = {}  # session id -> how it came in
        self._reaper: asyncio.Task[None] | None = None
        self._draining = False

    @property
    def available_transports(self) -> list[int]:
        """Transport numbers (dpu.v1.Transport) sessions can use, preferred first."""
        return sorted(self._transports)

    def start(self) -> None:
        """Start reaping orphaned sessions."""
        self._reaper = asyncio.create_task(self._reap(), name="session-reaper")

    async def drain(self, timeout: float) -> None:  # noqa: ASYNC109
        """Take no new sessions or jobs; wait up to `timeout` s for open jobs to finish."""
        self._draining = True
        for session in self._sessions.values():
            session.accepting = False
        idle = asyncio.gather(*(s.wait_idle() for s in self._sessions.values()))
        try:
            await asyncio.wait_for(idle, timeout)
        except TimeoutError:
            log.warning("jobs still open after the grace period; cancelling them")

    async def stop(self) -> None:
        """Close every session (agent shutdown)."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await asyncio.gather(*(s.close("agent shutting down") for s in self._sessions.values()))
        for _ in self._sessions:
            self._closed("shutdown")
        self._sessions.clear()
        self._admitted.clear()

    async def open(  # noqa: PLR0913 - the OpenSession fields
        self,
        *,
        tenant: str,
        transport: int,
        queue_depth: int,
        label: str,
        host: PeerAddress | None,
        request_id: str = "",
        connection: str = "",
    ) -> Session:
        """Open a session and connect its data plane to the host.

        `connection` names the client connection (the gRPC peer) it is opened over.
        """
        if self._draining:
            raise Unavailable("the agent is shutting down and opens no sessions")
        remembered = (tenant, request_id)
        if request_id and remembered in self._by_request:
            existing = self._sessions.get(self._by_request[remembered])
            if existing is not None:
                return existing
        kind = self._choose_transport(transport, host)
        if host is None:
            raise InvalidArgument("host_endpoint is required")
        depth = queue_depth or self.settings.default_queue_depth
        if not 1 <= depth <= self.settings.max_queue_depth:
            raise InvalidArgument(
                f"queue_depth must be 1..{self.settings.max_queue_depth}, not {depth}"
            )
        if len(self._sessions) + len(self._connecting) >= self.settings.max_sessions:
            raise ResourceExhausted(
                f"the agent serves at most {self.settings.max_sessions} sessions"
            )
        held = [s.queue_depth for s in self._sessions.values() if s.tenant == tenant]
        held += [d for t, d, _ in self._connecting if t == tenant]
        self._quotas.check_sessions(tenant, len(held) + 1, sum(held) + depth)
        self._check_connection(connection)
        reservation = (tenant, depth, connection)
        self._connecting.append(reservation)
        try:
            session = await self._connect(tenant, kind, depth, label, host)
        finally:
            self._connecting.remove(reservation)
        self._sessions[session.session_id] = session
        self._admitted[session.session_id] = _Admitted(connection, session.unwatched_since)
        if self._metrics is not None:
            self._metrics.session_opened(kind)
        if request_id:
            self._by_request[remembered] = session.session_id
            while len(self._by_request) > MAX_REMEMBERED_OPENS:
                self._by_request.popitem(last=False)
        log.info(
            "session opened",
            extra={
                "session": session.name,
                "tenant": tenant,
                "transport": kind,
                "queue_depth": depth,
                "label": label,
            },
        )
        return session

    def _check_connection(self, connection: str) -> None:
        """ResourceExhausted if `connection` already holds its share of sessions."""
        limit = self.settings.max_sessions_per_connection
        held = sum(1 for a in self._admitted.values() if a.connection == connection)
        held += sum(1 for _, _, c in self._connecting if c == connection)
        if held >= limit:
            raise ResourceExhausted(
                f"this client connection holds {held} sessions, the most one connection "
                f"may hold ([dataplane] max_sessions_per_connection = {limit})"
            )

    async def _connect(
        self, tenant: str, kind: int, depth: int, label: str, host: PeerAddress
    ) -> Session:
        session_id = "s-" + secrets.token_hex(6)
        session = Session(
            session_id,
            tenant=tenant,
            label=label,
            transport_kind=kind,
            transport=self._transports[kind](depth),
            settings=SessionSettings(
                queue_depth=depth,
                chunk_size=self.settings.chunk_size,
                default_deadline=self.settings.default_deadline,
            ),
            on_completion=self._on_completion,
            store=self._store,
            metrics=self._metrics,
        )
        try:
            await session.connect(host)
        except TransportError as exc:
            await session.transport.close()
            raise Unavailable(f"cannot connect the data plane to the host: {exc}") from None
        return session

    def _choose_transport(self, requested: int, host: PeerAddress | None) -> int:
        if requested == 0:
            if isinstance(host, TcpAddress):
                requested = TRANSPORT_TCP
            elif isinstance(host, VerbsAddress):
                requested = TRANSPORT_VERBS
            else:
                requested = min(self._transports)
        if requested not in self._transports:
            what = "verbs (no usable RDMA device)" if requested == TRANSPORT_VERBS else "tcp"
            raise FailedPrecondition(f"transport {what} is not available on this agent")
        want = VerbsAddress if requested == TRANSPORT_VERBS else TcpAddress
        if host is not None and not isinstance(host, want):
            raise InvalidArgument(
                f"host_endpoint does not match the {want.__name__[:-7].lower()} transport"
            )
        return requested

    def get(self, name: str) -> Session:
        """The session with this resource name."""
        (session_id,) = names.parse_name(name, "sessions")
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFound(f"{name} does not exist")
        return session

    def page(
        self,
        page_size: int,
        page_token: str,
        keep: Callable[[Session], bool] = lambda _: True,
    ) -> tuple[list[Session], str]:
        """One page of the sessions `keep` accepts, in name order, and the next page's token."""
        chosen = [s for s in self._sessions.values() if keep(s)]
        return paging.page(chosen, lambda s: s.name, page_size, page_token)

    async def close(self, name: str) -> None:
        """Close and forget a session."""
        session = self.get(name)
        await session.close()
        if self._forget(session):
            self._closed("closed")
        log.info("session closed", extra={"session": name})

    async def _reap(self) -> None:
        orphan, first = self.settings.orphan_timeout, self.settings.first_watch_timeout
        never_watched = min(orphan, first)
        while True:
            await asyncio.sleep(max(0.05, min(1.0, orphan / 2, never_watched / 2)))
            now = time.monotonic()
            for session in list(self._sessions.values()):
                since = session.unwatched_since
                failed = session.state == SessionState.FAILED
                admitted = self._admitted.get(session.session_id)
                never = admitted is not None and since == admitted.unwatched_at_open
                if since is not None and now - since > (never_watched if never else orphan):
                    why = "no host ever watched it" if never else "host gone: no watcher"
                    log.warning("closing orphaned session", extra={"session": session.name})
                    await session.close(why)
                elif failed and since is not None:
                    await session.close()
                else:
                    continue
                if self._forget(session):
                    # a host that died closed its end of the link: orphaned too
                    self._closed("failed" if failed and not session.host_gone else "orphaned")

    def _forget(self, session: Session) -> bool:
        """Drop a closed session; False if it was gone already."""
        self._admitted.pop(session.session_id, None)
        return self._sessions.pop(session.session_id, None) is not None

    def sessions(self) -> list[Session]:
        """Every session."""
        return list(self._sessions.values())

    def _closed(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.session_closed(reason)

"""All sessions of the agent: open, find, list, close, and reap the orphaned ones.

A session stays alive while its host watches it (a WatchCompletions stream, which
the SDK opens right after OpenSession and keeps open for the session's life). When
the last stream ends (host gone, network cut) and none comes back within
`orphan_timeout`, the session is closed: its queue pair is destroyed and its regions
forgotten. A session that no stream ever watched lives `first_watch_timeout` (or
`orphan_timeout` if that is shorter), so a client cannot hold slots by opening
sessions it never uses.

A session whose data plane failed stays listed, FAILED with its error, for
`failed_retention` seconds (whether or not a host watches it), then it is forgotten.

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
import contextlib
import dataclasses
import logging
import secrets
import time
from typing import TYPE_CHECKING, Final

from dpu_agent import paging
from dpu_agent.dataplane.bus import CompletionBus
from dpu_agent.dataplane.session import Session, SessionSettings
from dpu_agent.dataplane.volumes import TenantVolumes
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
    from collections.abc import Awaitable, Callable

    from dpu_agent.dataplane.reactor import Reactor
    from dpu_agent.dataplane.session import SessionEvents
    from dpu_agent.storage import VolumeStore
    from dpu_wire.transport.base import AgentLink, PeerAddress
    from dpu_wire.v1 import session_pb2

    LinkFactory = Callable[[PeerAddress, int, str], Awaitable[AgentLink]]
    """(host address, queue depth, the gRPC peer's IP) -> a connected link."""

log = logging.getLogger(__name__)

TRANSPORT_VERBS: Final = int(agent_pb2.TRANSPORT_VERBS)
TRANSPORT_TCP: Final = int(agent_pb2.TRANSPORT_TCP)


class _FirstCancelled(Exception):
    """The open a retry waited for was cancelled before it answered."""


def _retrieve(future: asyncio.Future[Session]) -> None:
    """Mark an open's outcome as seen, so one no retry waited for is not logged."""
    if not future.cancelled():
        future.exception()


@dataclasses.dataclass(frozen=True)
class ManagerSettings:
    """Limits of the session manager."""

    max_sessions: int = 64
    max_sessions_per_connection: int = 8
    max_queue_depth: int = 1024
    default_queue_depth: int = 32
    orphan_timeout: float = 10.0  # after the last watcher left
    first_watch_timeout: float = 5.0  # for a session no watcher ever came to
    failed_retention: float = 30.0
    chunk_size: int = 1 << 20
    large_buffers: int = 4
    default_deadline: float = 60.0


class SessionManager:
    """Owns every session; the gRPC services are thin layers over it."""

    def __init__(  # noqa: PLR0913 - the manager's parts, by keyword after the first
        self,
        settings: ManagerSettings,
        transports: dict[int, LinkFactory],
        *,
        reactor: Reactor,
        bus: CompletionBus | None = None,
        store: VolumeStore | None = None,
        quotas: Quotas | None = None,
        events: SessionEvents | None = None,
    ) -> None:
        self.settings = settings
        self._store = store
        self._events = events
        self._transports = transports
        self._reactor = reactor
        self.bus = bus or CompletionBus()
        self._quotas = quotas or Quotas()
        self._sessions: dict[str, Session] = {}
        self._connections: dict[str, str] = {}  # session id -> the gRPC peer that opened it
        # (tenant, request_id) -> session id, for idempotent open (DP-1.1-4): kept as long
        # as the session is (so bounded by the sessions), whatever other tenants open
        self._by_request: dict[tuple[str, str], str] = {}
        # (tenant, queue depth, connection) of the sessions being opened
        self._connecting: list[tuple[str, int, str]] = []
        # (tenant, request_id) -> the session of an open still connecting: a retry that
        # arrives meanwhile waits for it (DP-1.1-4), bounded like _connecting
        self._opening: dict[tuple[str, str], asyncio.Future[Session]] = {}
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
        self._connections.clear()

    async def open(  # noqa: PLR0913 - the OpenSession fields
        self,
        *,
        tenant: str,
        transport: int,
        queue_depth: int,
        label: str,
        host: PeerAddress | None,
        request_id: str = "",
        peer: str = "",
    ) -> Session:
        """Open a session and connect its data plane to the host.

        `peer` is the gRPC peer the call came over ("ipv4:1.2.3.4:5678"): the client
        connection the per-connection limit counts, and the address the tcp data plane
        may dial.
        """
        if self._draining:
            raise Unavailable("the agent is shutting down and opens no sessions")
        remembered = (tenant, request_id)
        if request_id:
            replayed = await self._replay(remembered)
            if replayed is not None:
                return replayed
        kind = self._choose_transport(transport, host)
        if host is None:
            raise InvalidArgument("host_endpoint is required")
        depth = queue_depth or self.settings.default_queue_depth
        if not 1 <= depth <= self.settings.max_queue_depth:
            raise InvalidArgument(
                f"queue_depth must be 1..{self.settings.max_queue_depth}, not {depth}"
            )
        self._admit(tenant, depth, peer)
        reservation = (tenant, depth, peer)
        self._connecting.append(reservation)
        try:
            session = await self._once(
                remembered if request_id else None,
                self._connect(tenant, kind, depth, label, host, peer),
            )
        finally:
            self._connecting.remove(reservation)
        self._sessions[session.session_id] = session
        self._connections[session.session_id] = peer
        if self._events is not None:
            self._events.session_opened(kind)
        if request_id:
            self._by_request[remembered] = session.session_id
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

    async def _replay(self, remembered: tuple[str, str]) -> Session | None:
        """The session an earlier OpenSession of this (tenant, request_id) opened, or None.

        A retry of one still connecting waits for its answer, an error included (DP-1.1-4);
        if that call was cancelled before it answered, the retry opens the session itself.
        """
        while (opening := self._opening.get(remembered)) is not None:
            with contextlib.suppress(_FirstCancelled):  # then it opens the session itself
                return await asyncio.shield(opening)
        if remembered in self._by_request:
            return self._sessions.get(self._by_request[remembered])
        return None

    async def _once(self, key: tuple[str, str] | None, connect: Awaitable[Session]) -> Session:
        """Await `connect`; retries of `key` that arrive meanwhile wait for its outcome."""
        if key is None:  # no request_id: nothing can retry it
            return await connect
        opening: asyncio.Future[Session] = asyncio.get_running_loop().create_future()
        opening.add_done_callback(_retrieve)
        self._opening[key] = opening
        try:
            session = await connect
        except asyncio.CancelledError:
            opening.set_exception(_FirstCancelled())
            raise
        except BaseException as exc:
            opening.set_exception(exc)
            raise
        finally:
            if self._opening.get(key) is opening:
                del self._opening[key]
        opening.set_result(session)
        return session

    def _admit(self, tenant: str, depth: int, peer: str) -> None:
        """ResourceExhausted if one more session of `depth` passes a limit."""
        if len(self._sessions) + len(self._connecting) >= self.settings.max_sessions:
            raise ResourceExhausted(
                f"the agent serves at most {self.settings.max_sessions} sessions"
            )
        held = [s.queue_depth for s in self._sessions.values() if s.tenant == tenant]
        held += [d for t, d, _ in self._connecting if t == tenant]
        self._quotas.check_sessions(tenant, len(held) + 1, sum(held) + depth)
        self._check_connection(peer)

    def _check_connection(self, connection: str) -> None:
        """ResourceExhausted if `connection` already holds its share of sessions."""
        limit = self.settings.max_sessions_per_connection
        held = sum(1 for c in self._connections.values() if c == connection)
        held += sum(1 for _, _, c in self._connecting if c == connection)
        if held >= limit:
            raise ResourceExhausted(
                f"this client connection holds {held} sessions, the most one connection "
                f"may hold ([dataplane] max_sessions_per_connection = {limit})"
            )

    async def _connect(  # noqa: PLR0913, PLR0917 - the session's identity and its host
        self, tenant: str, kind: int, depth: int, label: str, host: PeerAddress, peer: str
    ) -> Session:
        try:
            link = await self._transports[kind](host, depth, peer)
        except TransportError as exc:
            raise Unavailable(f"cannot connect the data plane to the host: {exc}") from None
        try:
            session = Session(
                "s-" + secrets.token_hex(6),
                tenant=tenant,
                label=label,
                transport_kind=kind,
                link=link,
                settings=SessionSettings(
                    queue_depth=depth,
                    chunk_size=self.settings.chunk_size,
                    large_buffers=self.settings.large_buffers,
                    default_deadline=self.settings.default_deadline,
                ),
                reactor=self._reactor,
                bus=self.bus,
                storage=None if self._store is None else TenantVolumes(self._store, tenant),
                events=self._events,
            )
        except BaseException:
            link.close()
            raise
        session.start()
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
        request: session_pb2.ListSessionsRequest,
        keep: Callable[[Session], bool] = lambda _: True,
    ) -> tuple[list[Session], str]:
        """One page of the sessions `keep` accepts, in name order, and the next page's token."""
        chosen = [s for s in self._sessions.values() if keep(s)]
        return paging.page(chosen, lambda s: s.name, request)

    async def close(self, name: str) -> None:
        """Close and forget a session."""
        session = self.get(name)
        await session.close()
        if self._forget(session):
            self._closed("closed")
        log.info("session closed", extra={"session": name})

    async def _reap(self) -> None:
        settings = self.settings
        never_watched = min(settings.orphan_timeout, settings.first_watch_timeout)
        pause = min(1.0, settings.orphan_timeout / 2, never_watched / 2)
        while True:
            await asyncio.sleep(max(0.05, pause))
            now = time.monotonic()
            for session in list(self._sessions.values()):
                since = session.unwatched_since
                failed_at = session.failed_at
                if failed_at is not None:
                    if now - failed_at <= settings.failed_retention:
                        continue
                    await session.close()
                    # a host that died closed its end of the link: orphaned too
                    reason = "orphaned" if session.host_gone else "failed"
                elif since is not None and now - since > (
                    settings.orphan_timeout if session.ever_watched else never_watched
                ):
                    why = "host gone: no watcher" if session.ever_watched else "never watched"
                    log.warning("closing orphaned session", extra={"session": session.name})
                    await session.close(why)
                    reason = "orphaned"
                else:
                    continue
                if self._forget(session):
                    self._closed(reason)

    def _forget(self, session: Session) -> bool:
        """Drop a closed session; False if it was gone already."""
        self._connections.pop(session.session_id, None)
        for key in [k for k, v in self._by_request.items() if v == session.session_id]:
            del self._by_request[key]
        return self._sessions.pop(session.session_id, None) is not None

    def sessions(self) -> list[Session]:
        """Every session."""
        return list(self._sessions.values())

    def reactor_load(self) -> tuple[int, int]:
        """(links the data-plane reactor drives, passes it has made): for the metrics."""
        return self._reactor.links, self._reactor.passes

    def tenant_pauses(self) -> dict[str, int]:
        """Per tenant: times its data-plane links were not read for a while.

        Each time it had spent its allowance of futile capsules (`refusals_per_s`).
        """
        return {t: n for t, n in dict(self._reactor.pauses).items() if isinstance(t, str)}

    def offload_load(self) -> dict[str, tuple[int, int]]:
        """Per worker pool (compute, io): (calls waiting, the most that ever waited)."""
        return self._reactor.offload_load()

    def telemetry(self) -> dict[str, object]:
        """How many sessions, by state, and their open jobs and counters (a snapshot).

        The sums cover the sessions that exist now (a closed session's counters leave
        with it), so they are a snapshot, not a monotonic total.
        """
        by_state: dict[str, int] = {}
        totals = dict.fromkeys(
            (
                "open_jobs",
                "jobs_submitted",
                "jobs_completed",
                "jobs_failed",
                "bytes_read",
                "bytes_written",
            ),
            0,
        )
        sessions = self.sessions()
        for session in sessions:
            by_state[session.state.name] = by_state.get(session.state.name, 0) + 1
            c = session.counters
            totals["open_jobs"] += session.open_jobs
            totals["jobs_submitted"] += c.jobs_submitted
            totals["jobs_completed"] += c.jobs_completed
            totals["jobs_failed"] += c.jobs_failed
            totals["bytes_read"] += c.bytes_read
            totals["bytes_written"] += c.bytes_written
        return {"sessions": len(sessions), "sessions_by_state": by_state, **totals}

    def _closed(self, reason: str) -> None:
        if self._events is not None:
            self._events.session_closed(reason)

"""A session: one host's data plane, as the control plane sees and steers it.

The session owns what the gRPC services act on: its identity and state, the regions
the host advertised, the volumes it attached and the keys it registered, its
WatchCompletions streams. Its jobs run in its `Pipeline` on the data-plane reactor's
thread; the control plane hands work there (`Reactor.call`) and reads snapshots of
the job tables back, and never waits on the reactor except for an answer it asked
for (a SubmitJob admission, a close).

Jobs arrive two ways: as SUBMIT capsules on the data plane (answered with a COMPLETION
capsule) or through JobService.SubmitJob (answered on the watch streams). Either way a
job finishes exactly once, and every finished job goes to the completion bus and the
session's watchers.

Job ids: the host picks ids below 2**63 for its capsules; the agent numbers the jobs
it receives through gRPC from 2**63 up, so the two never collide.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import itertools
import logging
import time
from typing import TYPE_CHECKING, Final, Protocol

from dpu_agent import request_context, status
from dpu_agent.dataplane import compute
from dpu_agent.dataplane.bus import Watcher
from dpu_agent.dataplane.pipeline import Pipeline, SessionHooks
from dpu_agent.dataplane.regions import RegionTable
from dpu_agent.dataplane.staging import Staging
from dpu_agent.errors import FailedPrecondition, NotFound, ResourceExhausted, Unavailable
from dpu_wire import capsule
from dpu_wire.capsule import U32_MAX, State
from dpu_wire.transport.base import PeerClosed

if TYPE_CHECKING:
    from collections.abc import Sequence

    from dpu_agent.dataplane.admission import JobRequest
    from dpu_agent.dataplane.bus import CompletionBus
    from dpu_agent.dataplane.jobs import JobRecord, Origin
    from dpu_agent.dataplane.pipeline import Counters
    from dpu_agent.dataplane.reactor import Reactor
    from dpu_agent.dataplane.runners import Storage
    from dpu_wire.transport.base import AgentLink, PeerAddress, TransportError

log = logging.getLogger(__name__)

MAX_WATCHERS: Final = 16  # WatchCompletions streams per session (the SDK holds one)
MAX_ATTACHED_VOLUMES: Final = 1024
MAX_KEYS: Final = 256


class SessionState(enum.IntEnum):
    """dpu.v1.SessionState numbers."""

    CONNECTING = 1
    ACTIVE = 2
    CLOSING = 3
    CLOSED = 4
    FAILED = 5


@dataclasses.dataclass(frozen=True)
class SessionSettings:
    """Per-session limits and defaults."""

    queue_depth: int = 32
    chunk_size: int = 1 << 20
    large_buffers: int = 4
    default_deadline: float = 60.0
    retained: int = 1024


class SessionEvents(Protocol):
    """Facts about sessions the agent counts (the metrics implement this)."""

    def session_opened(self, transport: int) -> None:
        """A session's data plane connected."""

    def session_closed(self, reason: str) -> None:
        """A session was closed and forgotten (closed, orphaned, failed, shutdown)."""

    def capsule_rejected(self) -> None:
        """A capsule was answered without making a job."""

    def dataplane_failed(self, transport: int) -> None:
        """The session's data plane failed (the host closing its end aside)."""


class Session(SessionHooks):
    """One host's session (see the module docstring)."""

    def __init__(  # noqa: PLR0913 - the session's identity and its parts
        self,
        session_id: str,
        *,
        tenant: str,
        label: str,
        transport_kind: int,
        link: AgentLink,
        settings: SessionSettings,
        reactor: Reactor,
        bus: CompletionBus,
        storage: Storage | None = None,
        events: SessionEvents | None = None,
    ) -> None:
        self.session_id = session_id
        self.name = f"sessions/{session_id}"
        # made inside OpenSession: its x-request-id, carried by the capsule jobs' events
        self.open_request_id = request_context.request_id.get()
        self.tenant = tenant
        self.label = label
        self.transport_kind = transport_kind
        self.link = link
        self.address: PeerAddress | None = link.address
        self.settings = settings
        self.state = SessionState.CONNECTING  # changed by `_set_state` only
        self.error: tuple[int, str] | None = None
        self.failed_at: float | None = None  # monotonic time the data plane failed
        self.host_gone = False  # the data plane failed because the host closed its end
        self.create_ns = time.time_ns()
        self.update_ns = self.create_ns  # the last change of state
        self.regions = RegionTable()
        self.accepting = True  # False while the agent drains for shutdown
        self.unwatched_since: float | None = time.monotonic()
        self.ever_watched = False
        self._reactor = reactor
        self._bus = bus
        self._events = events
        self._loop = asyncio.get_running_loop()
        self._watchers: tuple[Watcher, ...] = ()
        self._volumes: dict[int, str] = {}  # capsule handle -> volume id
        self._handles: dict[str, int] = {}
        self._next_handle = itertools.count(1)
        self._keys: dict[int, bytes] = {}  # encrypt/decrypt key handle -> key (memory only)
        self._next_key = itertools.count(1)
        self._grpc_ids = itertools.count(capsule.AGENT_JOB_ID_BASE)
        self._closing: asyncio.Future[None] | None = None
        self._staging = Staging(
            link,
            queue_depth=settings.queue_depth,
            chunk_size=settings.chunk_size,
            large=settings.large_buffers,
        )
        self._pipeline = Pipeline(
            hooks=self,
            link=link,
            reactor=reactor,
            staging=self._staging,
            regions=self.regions,
            storage=storage,
            queue_depth=settings.queue_depth,
            default_deadline=settings.default_deadline,
            open_request_id=self.open_request_id,
            retained=settings.retained,
        )

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """The link is connected: hand it to the reactor and take jobs."""
        self._set_state(SessionState.ACTIVE)
        pipeline = self._pipeline
        self._reactor.call(lambda: self._reactor.add(self.link, pipeline, self.tenant))

    async def close(self, reason: str = "session closed") -> None:
        """Cancel open jobs (their completions are sent), destroy the data plane. Idempotent."""
        if self._closing is not None:
            await asyncio.shield(self._closing)
            return
        self._closing = self._loop.create_future()
        failed = self.state == SessionState.FAILED
        self._set_state(SessionState.CLOSING)
        done = self._loop.create_future()

        def closed() -> None:
            self._loop.call_soon_threadsafe(_resolve, done)

        pipeline = self._pipeline
        self._reactor.call(
            lambda: pipeline.close(State.CANCELLED, status.CANCELLED, reason, closed)
        )
        await done
        self._end_watchers()
        self.regions.clear()
        self._keys.clear()
        self._set_state(SessionState.FAILED if failed else SessionState.CLOSED)
        self._closing.set_result(None)

    def _end_watchers(self) -> None:
        for watcher in self._watchers:
            watcher.send([None])

    def _set_state(self, state: SessionState) -> None:
        self.state = state
        self.update_ns = time.time_ns()

    @property
    def active(self) -> bool:
        """Whether the session takes jobs."""
        return self.state == SessionState.ACTIVE

    # ------------------------------------------------------------------ reactor-side hooks
    def check_accepting(self) -> None:
        """FailedPrecondition unless ACTIVE; Unavailable while the agent drains."""
        if self.state != SessionState.ACTIVE:
            detail = f": {self.error[1]}" if self.error else ""
            raise FailedPrecondition(f"{self.name} is {self.state.name}{detail}")
        if not self.accepting:
            raise Unavailable("the agent is shutting down and takes no new jobs")

    def ready(self) -> bool:
        """Whether `check_accepting` would pass."""
        return self.state == SessionState.ACTIVE and self.accepting

    def volume_of(self, handle: int) -> str | None:
        """The volume attached under `handle`."""
        return self._volumes.get(handle)

    def key_of(self, handle: int) -> bytes | None:
        """The AES key registered under `handle`."""
        return self._keys.get(handle)

    def finished(self, jobs: list[JobRecord]) -> None:
        """Publish a pass's finished jobs: the bus, then this session's watchers."""
        self._bus.publish(self, jobs)
        for watcher in self._watchers:
            wanted = [job for job in jobs if watcher.wants(job)]
            if wanted:
                watcher.send(wanted)

    def data_plane_failed(self, error: TransportError) -> None:
        """The link failed: FAILED (visible as such until the manager reaps it)."""
        if self.state not in (SessionState.ACTIVE, SessionState.CONNECTING):
            return
        message = f"data plane failed: {error}"
        log.warning("session failed", extra={"session": self.name, "error": str(error)})
        self._set_state(SessionState.FAILED)
        self.error = (status.UNAVAILABLE, message)
        self.failed_at = time.monotonic()
        self.host_gone = isinstance(error, PeerClosed)
        if self._events is not None and not self.host_gone:
            self._events.dataplane_failed(self.transport_kind)
        pipeline = self._pipeline
        pipeline.end_pass()  # the failed jobs go out before the streams end
        self._end_watchers()
        pipeline.close(State.FAILED, status.UNAVAILABLE, message, lambda: None)

    def rejected(self) -> None:
        """Count a capsule answered without a job."""
        if self._events is not None:
            self._events.capsule_rejected()

    # ------------------------------------------------------------------ jobs
    @property
    def queue_depth(self) -> int:
        """Maximum number of open jobs."""
        return self.settings.queue_depth

    @property
    def open_jobs(self) -> int:
        """Jobs admitted and not finished."""
        return len(self._pipeline.open)

    @property
    def counters(self) -> Counters:
        """The session's job counters."""
        return self._pipeline.counters

    def next_job_id(self) -> int:
        """An id for a SubmitJob job (from 2**63 up)."""
        return next(self._grpc_ids)

    async def submit(
        self, request: JobRequest, *, request_id: str = "", wait_for_slot: bool = False
    ) -> JobRecord:
        """Admit a SubmitJob job through the one admission path (idempotent on request_id)."""
        self.check_accepting()
        loop = self._loop
        answered: asyncio.Future[JobRecord | BaseException] = loop.create_future()
        rpc_request_id = request_context.request_id.get()

        def answer(result: JobRecord | BaseException) -> None:
            loop.call_soon_threadsafe(_resolve_with, answered, result)

        pipeline = self._pipeline
        self._reactor.call(
            lambda: pipeline.submit_rpc(
                request,
                request_id=request_id,
                rpc_request_id=rpc_request_id,
                wait_for_slot=wait_for_slot,
                answer=answer,
            )
        )
        try:
            result = await answered
        except asyncio.CancelledError:  # the RPC went away: a waiting request is dropped
            self._reactor.call(lambda: pipeline.withdraw(answer))
            raise
        if isinstance(result, BaseException):
            raise result
        return result

    def job(self, job_id: int) -> JobRecord:
        """An open or retained job."""
        pipeline = self._pipeline
        found = pipeline.open.get(job_id) or pipeline.retained.get(job_id)
        if found is None:
            raise NotFound(f"{self.name}/jobs/{job_id} does not exist (or is no longer retained)")
        return found

    def jobs(self) -> list[JobRecord]:
        """Open and retained jobs, by id (a snapshot)."""
        pipeline = self._pipeline
        found = [*list(pipeline.open.values()), *list(pipeline.retained.values())]
        return sorted({job.job_id: job for job in found}.values(), key=lambda j: j.job_id)

    def cancel(self, job_id: int) -> JobRecord:
        """Ask a job to stop; it completes CANCELLED unless it finished already."""
        job = self.job(job_id)
        if not job.done:
            job.cancel_requested = True
            pipeline = self._pipeline
            self._reactor.call(lambda: pipeline.cancel(job_id, "cancelled by request"))
        return job

    async def wait_idle(self, poll: float = 0.02) -> None:
        """Wait until no job is open (polled: draining for shutdown is rare)."""
        while self._pipeline.open and self.state == SessionState.ACTIVE:  # noqa: ASYNC110
            await asyncio.sleep(poll)

    # ------------------------------------------------------------------ volumes, keys
    def attach(self, volume_id: str) -> int:
        """The handle capsules use for a volume (the same one if already attached).

        The caller checked that the volume exists and is the session tenant's.
        """
        self.check_accepting()
        if volume_id in self._handles:
            return self._handles[volume_id]
        if len(self._volumes) >= MAX_ATTACHED_VOLUMES:
            raise ResourceExhausted(f"a session attaches at most {MAX_ATTACHED_VOLUMES} volumes")
        handle = next(self._next_handle)
        if handle > U32_MAX:  # handles are not reused (data-plane.md 1.4)
            raise ResourceExhausted(f"{self.name} has used all {U32_MAX} volume handles")
        self._volumes[handle] = volume_id
        self._handles[volume_id] = handle
        return handle

    def handle_of(self, volume_id: str) -> int:
        """The attachment handle of a volume; FailedPrecondition if it is not attached."""
        handle = self._handles.get(volume_id)
        if handle is None:
            raise FailedPrecondition(
                f"volumes/{volume_id} is not attached to {self.name} (AttachVolume first)"
            )
        return handle

    def detach(self, volume_id: str) -> None:
        """Remove a volume's handle from the session."""
        handle = self._handles.pop(volume_id, None)
        if handle is None:
            raise NotFound(f"volumes/{volume_id} is not attached to {self.name}")
        del self._volumes[handle]

    def register_key(self, key: bytes) -> int:
        """A handle for an AES key, for this session's encrypt and decrypt jobs."""
        self.check_accepting()
        compute.check_key(key)
        if len(self._keys) >= MAX_KEYS:
            raise ResourceExhausted(f"a session registers at most {MAX_KEYS} keys")
        handle = next(self._next_key)
        self._keys[handle] = key
        return handle

    # ------------------------------------------------------------------ watchers
    def watch(self, *, include_retained: bool, origin: Origin | None = None) -> Watcher:
        """A new watcher of finished jobs (ended at once if the session is over)."""
        if len(self._watchers) >= MAX_WATCHERS:
            raise ResourceExhausted(f"{self.name} is watched by {MAX_WATCHERS} streams already")
        watcher = Watcher(self._loop, origin)
        if include_retained:
            watcher.put_many([j for j in self._pipeline.retained.values() if watcher.wants(j)])
        if self.state != SessionState.ACTIVE:
            watcher.put(None)
        self._watchers = (*self._watchers, watcher)
        self.unwatched_since = None
        self.ever_watched = True
        return watcher

    def unwatch(self, watcher: Watcher) -> None:
        """Forget a watcher; with none left, the orphan clock starts."""
        self._watchers = tuple(w for w in self._watchers if w is not watcher)
        if not self._watchers:
            self.unwatched_since = time.monotonic()

    @property
    def watchers(self) -> Sequence[Watcher]:
        """The open WatchCompletions streams."""
        return self._watchers


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _resolve_with(
    future: asyncio.Future[JobRecord | BaseException], result: JobRecord | BaseException
) -> None:
    if not future.done():
        future.set_result(result)

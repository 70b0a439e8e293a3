"""The completion bus: where every finished job goes, whichever way it arrived.

The data plane publishes each pass's finished jobs once, as a batch, on the reactor
thread (`CompletionBus.publish`). Two kinds of subscribers:

- agent-wide ones (`subscribe`): the metrics and the MQTT publisher. They are called on
  the reactor thread and must return at once: count, or hand the batch to their own
  loop (`loop.call_soon_threadsafe`, once per batch);
- the WatchCompletions streams of a session (`Watcher`), fed on the control plane's
  event loop, one hop per batch and stream, filtered by origin on the reactor thread
  (so the SDK's lease stream, which takes SubmitJob completions only, costs nothing
  on the capsule fast path).

The data plane knows none of its subscribers: they register here.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Final, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from dpu_agent.dataplane.jobs import JobRecord, Origin

log = logging.getLogger(__name__)

# Completions a stream may fall behind before it is ended. Eight times what a session
# retains for include_retained (its last 1,024 finished jobs): a stream further behind
# cannot be caught up anyway. A record held here costs about 550 bytes.
WATCHER_BACKLOG: Final = 8192


class Published(Protocol):
    """What subscribers learn about the session a batch belongs to."""

    @property
    def session_id(self) -> str:
        """The session id, "s-..." (its name without "sessions/")."""

    @property
    def name(self) -> str:
        """The resource name, "sessions/s-..."."""

    @property
    def tenant(self) -> str:
        """The session's owner."""

    @property
    def transport_kind(self) -> int:
        """dpu.v1.Transport number."""

    @property
    def open_request_id(self) -> str:
        """The x-request-id of the OpenSession call."""


class Watcher:
    """One WatchCompletions stream: finished jobs on the control loop, None at the end."""

    def __init__(self, loop: asyncio.AbstractEventLoop, origin: Origin | None = None) -> None:
        self.queue: asyncio.Queue[JobRecord | None] = asyncio.Queue()
        self.origin = origin
        self.overflowed = False
        self._loop = loop

    def wants(self, job: JobRecord) -> bool:
        """Whether this stream takes the job (its origin filter)."""
        return self.origin is None or job.origin == self.origin

    def put(self, job: JobRecord | None) -> None:
        """Queue a finished job or the end (on the control loop).

        A stream `WATCHER_BACKLOG` behind has overflowed: what it holds is dropped at
        once (a reader that stopped reading must not keep it) and it ends.
        """
        if self.overflowed:
            return
        queue = self.queue
        if job is not None and queue.qsize() >= WATCHER_BACKLOG:
            self.overflowed = True
            while not queue.empty():
                queue.get_nowait()
            queue.put_nowait(None)
            return
        queue.put_nowait(job)

    def put_many(self, jobs: Sequence[JobRecord]) -> None:
        """Queue several (on the control loop)."""
        for job in jobs:
            self.put(job)

    def send(self, jobs: Sequence[JobRecord | None]) -> None:
        """From any thread: queue these on the control loop."""
        try:
            self._loop.call_soon_threadsafe(self._deliver, list(jobs))
        except RuntimeError:  # the loop is closed: nobody listens any more
            log.debug("completion watcher's loop is closed")

    def _deliver(self, jobs: list[JobRecord | None]) -> None:
        for job in jobs:
            self.put(job)


class CompletionBus:
    """Agent-wide subscribers of finished jobs."""

    def __init__(self) -> None:
        self._subscribers: tuple[Callable[[Published, Sequence[JobRecord]], None], ...] = ()

    def subscribe(self, fn: Callable[[Published, Sequence[JobRecord]], None]) -> None:
        """Call `fn(session, jobs)` on the reactor thread for every batch."""
        self._subscribers = (*self._subscribers, fn)

    def publish(self, session: Published, jobs: Sequence[JobRecord]) -> None:
        """A batch of finished jobs of one session (reactor thread)."""
        for fn in self._subscribers:
            try:
                fn(session, jobs)
            except Exception:
                log.exception("a completion subscriber failed")

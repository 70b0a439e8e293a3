"""The data-plane reactor: one thread that runs every session's jobs to completion.

Modelled on SPDK's poll-mode reactors, within what Python allows: no event-loop task
per job, no asyncio on the fast path. One thread owns every session's link (`AgentLink`)
and runs a loop:

1. wait on an epoll set (the links' descriptors and a wake-up eventfd) for as long as
   nothing needs polling, or not at all while a verbs link is hot;
2. run what other threads handed over (`call`): new sessions, SubmitJob requests,
   finished worker-thread work, close requests;
3. poll every hot link, in turn, for at most `POLL_BUDGET` completions and capsules
   per tenant, shared by that tenant's hot links: they go to the link's sink (the
   session), which advances its jobs and posts their next operations right away. The
   budget is what keeps tenants apart: a host that floods its links with capsules gets
   the same share of each pass as every other tenant with work, however many sessions
   it opens, and the rest of its flood waits (in the link, then in the kernel's socket
   buffer, then in the host: TCP flow control). Capsules that run no job (refused,
   failed at admission, CANCELs of jobs not open) are also counted against the tenant's
   allowance a second (`allowance.Allowance`): past it, its links are not read until
   the allowance refills;
4. run due timers (deadlines, QoS waits);
5. give every session touched in this pass one call to finish the pass (flush the
   link, publish the jobs that finished; a tcp link's owner gets another call at once
   if that flush finished sends it waits on, so its pass ends here), and cool down idle
   verbs links: a link with nothing in flight and no activity for `spin` seconds is
   armed (its completion channel will wake the loop) and no longer polled.

Adaptive polling, then: a verbs link is polled continuously while work is in flight and
for `spin` seconds after, and sleeps on its completion channel otherwise (`spin` 0 is
pure event mode, a negative `spin` never sleeps). The window follows the link's
traffic: a link woken after sleeping less than `SPIN_GROWTH` times `spin` stays polled for
twice that sleep next time (so a client whose jobs come a few milliseconds apart, as on
a slow or loaded machine, is not put to sleep between every two of them), and one that
slept longer goes back to `spin`. A tcp link is driven by its socket's readiness, and
polled again at once while frames it read in one go wait for their turn (`backlog`).

CPU-heavy work (compression, encryption, hashing of large chunks) runs on a small pool
of worker threads whose libraries release the GIL; blocking storage calls (syncs,
large reads) on a second pool. Both serve their callers (sessions) in turn
(`fairpool.FairPool`), so one session's backlog never delays another's calls. Their
results come back through `call`. The control
plane (gRPC, on the asyncio loop in the main thread) never waits on this loop except
for an answer to a request it handed over (`call_async`), and this loop never waits on
the control plane's: what it hands back goes through `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import heapq
import itertools
import logging
import os
import select
import threading
import time
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar

from dpu_agent.dataplane.allowance import RESUME_AT, Allowance
from dpu_agent.dataplane.fairpool import FairPool

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable

    from dpu_wire.transport.base import AgentLink, LinkSink

log = logging.getLogger(__name__)

_T = TypeVar("_T")
POLL_BUDGET: Final = 64  # completions and capsules taken per pass from one tenant's hot links
CANCELLED_TIMERS_KEPT: Final = 64  # cancelled timers left in the heap before it is compacted
MAX_WAIT: Final = 1.0  # seconds the loop sleeps at most (overdue tcp requests are checked)
SETTLE_ROUNDS: Final = 4  # arm/end_pass rounds that end a tcp link's pass (see _settle)
SPIN_GROWTH: Final = 10  # an adaptive link's idle polling window grows to at most this times spin
# How long an idle pass may wait inside the one link the reactor serves for its next
# completion (`AgentLink.idle_wait`), instead of making another empty pass: what a request
# from the control plane can be held up by.
IDLE_WAIT_S: Final = 0.0005
_EPOLLIN: Final = select.EPOLLIN
_EPOLLOUT: Final = select.EPOLLOUT


class LinkOwner(Protocol):
    """What the reactor needs from the owner of a link (a session)."""

    @property
    def sink(self) -> LinkSink:
        """Where the link's completions and capsules go."""

    def end_pass(self) -> None:
        """The reactor finished a pass that touched this owner: flush, publish."""

    def link_failed(self) -> None:
        """The link reported an error (`link.error` says which)."""

    @property
    def futile(self) -> int:
        """Capsules so far that ran no job: what the tenant's allowance is charged.

        Refused ones, ones whose job failed at admission, CANCELs of jobs not open.
        """


@dataclasses.dataclass(eq=False)
class _Entry:
    link: AgentLink
    owner: LinkOwner
    fd: int
    polls: bool  # verbs: completions must be polled
    hot: bool = True  # polled every pass
    last: float = 0.0  # last activity (monotonic)
    spin: float = 0.0  # this link's idle polling window (adaptive, see the module's text)
    writing: bool = False  # EPOLLOUT registered
    tenant: object = None  # whose link: its hot links share one budget a pass
    watched: bool = True  # its descriptor is in the epoll set (until it fails)
    paused: bool = False  # its tenant spent its allowance: out of the epoll set, not polled
    futile_seen: int = 0  # the owner's `futile` when last charged
    removed: bool = False


def _nothing() -> None:
    pass


def _shares(hot: list[_Entry], low: dict[object, Allowance], now: float) -> dict[object, int]:
    """Each tenant's budget per hot link this pass: `POLL_BUDGET` split among its links.

    Less for a tenant in `low`, whose allowance of futile capsules is lower.
    """
    links: dict[object, int] = {}
    for entry in hot:
        if not entry.removed:
            links[entry.tenant] = links.get(entry.tenant, 0) + 1
    shares = {}
    for tenant, n in links.items():
        allowance = low.get(tenant)
        budget = POLL_BUDGET if allowance is None else allowance.share(POLL_BUDGET, now)
        shares[tenant] = max(1, budget // n)
    return shares


class Timer:
    """A call scheduled on the reactor; `cancel()` it from the reactor thread."""

    __slots__ = ("_reactor", "cancelled", "fn", "when")

    def __init__(self, when: float, fn: Callable[[], None], reactor: Reactor) -> None:
        self.when = when
        self.fn = fn
        self.cancelled = False
        self._reactor = reactor

    def cancel(self) -> None:
        """Do not run it, and let go of what it would have run at once."""
        if not self.cancelled:
            self.cancelled = True
            self.fn = _nothing
            self._reactor._timer_cancelled()  # noqa: SLF001 - the heap's bookkeeping


class Reactor:
    """The data plane's thread. Start it, hand it work with `call`, stop it.

    Args:
        spin: seconds a verbs link stays polled after its last activity (0: sleep
            at once when idle; negative: never sleep).
        compute_workers: threads for CPU-heavy job steps.
        io_workers: threads for blocking storage calls.
        on_crash: called on the reactor thread if it dies of an exception (after it is
            logged): the agent exits, since nothing answers its data plane any more.
        cpus: the CPUs the reactor's thread may run on (empty: any). A deployment gives
            the data plane its own cores; on the soft-RoCE test bed the CPU it lands on
            moved the transport's 4 KiB WRITE between 117 and 301 us (docs/performance.md).
        refusals_per_s: futile capsules a tenant may send a second (`allowance`; at
            least `allowance.RESUME_AT`); 0: no limit.
    """

    def __init__(  # noqa: PLR0913 - the loop's tunables, all keyword-only
        self,
        *,
        spin: float = 0.002,
        compute_workers: int = 2,
        io_workers: int = 16,
        on_crash: Callable[[BaseException], None] | None = None,
        cpus: frozenset[int] = frozenset(),
        refusals_per_s: int = 0,
    ) -> None:
        self.spin = spin
        if refusals_per_s and refusals_per_s < RESUME_AT:
            raise ValueError(f"refusals_per_s {refusals_per_s}: 0 (no limit) or >= {RESUME_AT}")
        self.refusals_per_s = refusals_per_s
        self._allowances: dict[object, Allowance] = {}  # by tenant, while it has links
        # the allowances below a pass's budget: they cap their tenant's share of a pass
        self._low: dict[object, Allowance] = {}
        # by tenant: times its links stopped being read, its allowance spent (metrics)
        self.pauses: dict[object, int] = {}
        self.cpus = cpus
        self._on_crash = on_crash
        self._epoll = select.epoll()
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll.register(self._wake_fd, _EPOLLIN)
        self._inbox: collections.deque[Callable[[], None]] = collections.deque()
        self._sleeping = False
        self._timers: list[tuple[float, int, Timer]] = []
        self._timer_seq = itertools.count()
        self._cancelled_timers = 0  # entries of _timers whose timer is cancelled
        self._entries: dict[int, _Entry] = {}  # by descriptor, for epoll's events
        # by link: a failed tcp link closed its socket, and its descriptor reads -1
        self._by_link: dict[AgentLink, _Entry] = {}
        self._hot: list[_Entry] = []
        self._touched: dict[_Entry, None] = {}  # entries to finish this pass, in order
        self._compute = FairPool(compute_workers, name="dataplane-compute")
        self._io = FairPool(io_workers, name="dataplane-io")
        self._thread: threading.Thread | None = None
        self._overdue_timer: Timer | None = None
        self._stopping = False
        self.passes = 0  # loop passes, for tests and diagnostics

    # ------------------------------------------------------------ from any thread

    def start(self) -> None:
        """Start the thread."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="dataplane-reactor", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop (what is queued runs first) and the worker pools.

        Worker calls not started are dropped; those running get what is left of
        `timeout` to return (the volume store closes next).
        """
        if self._thread is None:
            return
        end = time.monotonic() + timeout
        self.call(self._request_stop)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("the data-plane reactor did not stop within %.0f s", timeout)
        self._thread = None
        pools = (self._compute, self._io)
        for pool in pools:
            pool.close()
        for pool in pools:
            if not pool.join(max(0.0, end - time.monotonic())):
                log.error("%s calls still run after %.0f s", pool.name, timeout)
        self._epoll.close()
        os.close(self._wake_fd)

    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the reactor thread soon (thread-safe, never blocks)."""
        self._inbox.append(fn)
        if self._sleeping:
            with contextlib.suppress(BlockingIOError):
                os.eventfd_write(self._wake_fd, 1)

    def call_async(self, fn: Callable[[], _T]) -> asyncio.Future[_T]:
        """Run `fn` on the reactor; its result (or exception) on the caller's event loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_T] = loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's future
                loop.call_soon_threadsafe(_set_exception, future, exc)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

        self.call(run)
        return future

    @property
    def links(self) -> int:
        """How many links the loop drives (any thread may read it)."""
        return len(self._by_link)

    def offload_load(self) -> dict[str, tuple[int, int]]:
        """Per worker pool (compute, io): (calls waiting now, the most that ever waited)."""
        return {
            "compute": (self._compute.waiting, self._compute.peak_waiting),
            "io": (self._io.waiting, self._io.peak_waiting),
        }

    @property
    def in_thread(self) -> bool:
        """Whether the caller runs on the reactor thread."""
        return threading.current_thread() is self._thread

    # ------------------------------------------------------------ on the reactor thread

    def add(self, link: AgentLink, owner: LinkOwner, tenant: object = None) -> None:
        """Take a connected link over (the owner's sink gets its completions).

        `tenant`: the links of one tenant share one `POLL_BUDGET` a pass (None: a
        tenant of its own).
        """
        fd = link.fileno()
        now = time.monotonic()
        entry = _Entry(link, owner, fd, polls=link.needs_polling, last=now)
        entry.tenant = entry if tenant is None else tenant
        entry.futile_seen = owner.futile
        self._entries[fd] = entry
        self._by_link[link] = entry
        allowance = self._allowances.get(entry.tenant)
        if allowance is None and self.refusals_per_s:
            allowance = self._allowances[entry.tenant] = Allowance(self.refusals_per_s, now)
        if self._overdue_timer is None:
            self._overdue_timer = self.call_later(MAX_WAIT, self._check_overdue)
        if allowance is not None and allowance.resume is not None:  # the tenant waits
            entry.paused = True
            entry.hot = False
            return
        self._epoll.register(fd, _EPOLLIN)
        self._hot.append(entry)

    def remove(self, link: AgentLink) -> None:
        """Stop driving a link (the caller closes it)."""
        entry = self._by_link.pop(link, None)
        if entry is None:
            return
        entry.removed = True  # dropped from the hot list at the end of the pass
        self._charge_now(entry, time.monotonic())  # its capsules since the last pass
        if entry.tenant is entry:
            self.pauses.pop(entry, None)
        self._touched.pop(entry, None)
        if self._entries.get(entry.fd) is entry:  # not a newer link's reused descriptor
            del self._entries[entry.fd]
            with contextlib.suppress(OSError, ValueError):
                self._epoll.unregister(entry.fd)
        self._forget_allowances()

    def _unwatch(self, entry: _Entry) -> None:
        """A failed link's descriptor leaves the epoll set until its owner removes it.

        A failed tcp link keeps its socket until it is closed (DP-4-6), and a socket at
        end of stream is readable on every wait: the reactor would spin on it.
        """
        if entry.watched and self._entries.get(entry.fd) is entry:
            entry.watched = False
            with contextlib.suppress(OSError, ValueError):
                self._epoll.unregister(entry.fd)

    def wake(self, link: AgentLink) -> None:
        """Work was posted on `link`: poll it, and finish its owner's pass."""
        entry = self._by_link.get(link)
        if entry is None:
            return
        entry.last = time.monotonic()
        self._touched[entry] = None
        if not entry.hot and not entry.paused:
            entry.hot = True
            self._hot.append(entry)

    def read_now(self, link: AgentLink) -> None:
        """Read `link` outside a pass, as a pass would (a closing session drains it so).

        Nothing while its tenant is paused; no more than the tenant's share of a pass; the
        capsules that ran no job charged to the tenant's allowance.
        """
        entry = self._by_link.get(link)
        if entry is None or entry.paused:
            return
        now = time.monotonic()
        allowance = self._allowances.get(entry.tenant)
        budget = POLL_BUDGET if allowance is None else allowance.share(POLL_BUDGET, now)
        link.poll(entry.owner.sink, budget)
        self._charge_now(entry, now)

    def call_later(self, delay: float, fn: Callable[[], None]) -> Timer:
        """Run `fn` on this thread after `delay` seconds."""
        timer = Timer(time.monotonic() + delay, fn, self)
        heapq.heappush(self._timers, (timer.when, next(self._timer_seq), timer))
        return timer

    def _timer_cancelled(self) -> None:
        """A timer was cancelled: once most of the heap is cancelled, drop those entries.

        Else a peer that makes timers and has them cancelled (a throttled write, then its
        CANCEL) would fill the heap until their due times, hours away.
        """
        self._cancelled_timers += 1
        timers = self._timers
        if self._cancelled_timers > CANCELLED_TIMERS_KEPT and 2 * self._cancelled_timers > len(
            timers
        ):
            timers[:] = [entry for entry in timers if not entry[2].cancelled]  # in place:
            heapq.heapify(timers)  # _run_timers may be iterating over this list
            self._cancelled_timers = 0

    def compute(
        self,
        fn: Callable[[], _T],
        done: Callable[[concurrent.futures.Future[_T]], None],
        *,
        key: Hashable,
    ) -> concurrent.futures.Future[_T]:
        """Run `fn()` on a compute worker in `key`'s turn; `done(future)` back on this thread.

        Cancelling the future before the call started drops the call (`done` still comes).
        """
        return self._offload(self._compute, key, fn, done)

    def io(
        self,
        fn: Callable[[], _T],
        done: Callable[[concurrent.futures.Future[_T]], None],
        *,
        key: Hashable,
    ) -> concurrent.futures.Future[_T]:
        """Run `fn()` on a storage worker in `key`'s turn; `done(future)` back on this thread.

        Cancelling the future before the call started drops the call (`done` still comes).
        """
        return self._offload(self._io, key, fn, done)

    def _offload(
        self,
        pool: FairPool,
        key: Hashable,
        fn: Callable[[], _T],
        done: Callable[[concurrent.futures.Future[_T]], None],
    ) -> concurrent.futures.Future[_T]:
        try:
            future = pool.submit(key, fn)
        except RuntimeError as exc:  # shut down
            failed: concurrent.futures.Future[_T] = concurrent.futures.Future()
            failed.set_exception(exc)
            self.call(lambda: done(failed))
            return failed
        future.add_done_callback(lambda f: self.call(lambda: done(f)))
        return future

    # ------------------------------------------------------------ the loop

    def _request_stop(self) -> None:
        self._stopping = True

    def _run(self) -> None:
        try:
            if self.cpus:  # pid 0: this thread
                os.sched_setaffinity(0, self.cpus)
                log.info("the data-plane reactor runs on CPUs %s", sorted(self.cpus))
            while not self._stopping:
                self._pass()
        except BaseException as exc:
            log.exception("the data-plane reactor crashed")
            if self._on_crash is not None:
                self._on_crash(exc)
            raise

    def _pass(self) -> None:
        self.passes += 1
        events: list[tuple[int, int]] = []
        if not self._alone():
            timeout = self._timeout()
            if timeout:
                self._sleeping = True
                if self._inbox:
                    timeout = 0.0
            events = self._epoll.poll(timeout)
            self._sleeping = False
        if events:
            self._dispatch(events)
        inbox = self._inbox
        busy = bool(inbox)
        while inbox:
            fn = inbox.popleft()
            try:
                fn()
            except Exception:
                log.exception("a data-plane request failed")
        busy = self._poll_hot() or busy or bool(events)
        self._run_timers()
        self._finish_pass()
        if not busy and not self._idle_wait():
            # An idle spin: give the GIL away for a moment, or the control plane's thread
            # waits a whole switch interval (5 ms) for it whenever it has work.
            time.sleep(0)

    def _alone(self) -> bool:
        """Whether the one link there is, is hot and polled (verbs): no epoll then.

        The epoll would be a system call for nothing (a third of a busy reactor's time
        in the test VM): the link is not armed while hot, the only other descriptor is
        the wake fd, which `call` writes only while the loop sleeps, and the inbox is
        read every pass. A link added meanwhile ends it (two entries).
        """
        hot = self._hot
        return len(hot) == 1 and len(self._entries) == 1 and hot[0].polls and not hot[0].removed

    def _idle_wait(self) -> bool:
        """Wait in the link for its next completion, when it is the only one and hot.

        Its core then polls both its queues with the GIL released (the control plane
        runs meanwhile), and a capsule or an operation's completion is taken the moment
        it lands, where an empty pass through the reactor's Python would cost its own
        time first. At most `IDLE_WAIT_S`, not past
        the next timer; never with other links, whose events it would keep waiting.
        """
        if not self._alone() or self._inbox or self._touched:
            return False
        wait = IDLE_WAIT_S
        if self._timers:
            wait = min(wait, self._timers[0][0] - time.monotonic())
        return wait > 0 and self._hot[0].link.idle_wait(wait)

    def _dispatch(self, events: list[tuple[int, int]]) -> None:
        entries, touched = self._entries, self._touched
        for fd, mask in events:
            if fd == self._wake_fd:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._wake_fd)
                continue
            entry = entries.get(fd)
            if entry is None or entry.paused:
                continue
            touched[entry] = None
            if mask & _EPOLLOUT:
                entry.link.flush()
            if mask & ~_EPOLLOUT:
                entry.link.on_event()
                if not entry.hot:
                    entry.hot = True
                    self._hot.append(entry)
                    self._adapt_spin(entry)

    def _timeout(self) -> float:
        """How long the next epoll may wait: 0 while a link is hot or work is queued."""
        if self._hot or self._inbox or self._touched:
            return 0.0
        if self._timers:
            return max(0.0, min(MAX_WAIT, self._timers[0][0] - time.monotonic()))
        return MAX_WAIT

    def _poll_hot(self) -> bool:
        """Poll every hot link, a tenant's sharing one budget; whether any had something."""
        now = time.monotonic()
        touched = self._touched
        found = False
        hot = self._hot
        low = self._low
        if low:
            for tenant in [t for t, a in low.items() if a.share(POLL_BUDGET, now) == POLL_BUDGET]:
                del low[tenant]
        shares = _shares(hot, low, now) if len(hot) > 1 or low else None
        charging = bool(self._allowances)
        spent: set[object] = set()
        for entry in hot:
            if entry.removed or entry.paused or (spent and entry.tenant in spent):
                continue  # a tenant that spent its allowance reads no more links this pass
            link = entry.link
            budget = POLL_BUDGET if shares is None else shares[entry.tenant]
            if link.poll(entry.owner.sink, budget):
                entry.last = now
                touched[entry] = None
                found = True
                if charging and entry.owner.futile != entry.futile_seen and self._charge(entry):
                    spent.add(entry.tenant)
            if link.error is not None:
                touched[entry] = None
        for tenant in spent:
            self._pause(tenant, now)
        return found

    def _charge(self, entry: _Entry) -> bool:
        """Charge the entry's new futile capsules to its tenant; whether that spent it."""
        futile = entry.owner.futile
        allowance = self._allowances.get(entry.tenant)
        if allowance is None:
            return False
        allowance.take(futile - entry.futile_seen)
        entry.futile_seen = futile
        if allowance.tokens < POLL_BUDGET:
            self._low[entry.tenant] = allowance
        return allowance.spent

    def _charge_now(self, entry: _Entry, now: float) -> None:
        """Outside a pass: charge the entry's new futile capsules; pause if that spent it."""
        if entry.owner.futile != entry.futile_seen and self._charge(entry):
            self._pause(entry.tenant, now)

    def _pause(self, tenant: object, now: float) -> None:
        """Stop reading a tenant's links until its allowance has refilled."""
        allowance = self._allowances[tenant]
        for entry in self._by_link.values():
            if entry.tenant == tenant and not entry.paused:
                entry.paused = True
                entry.hot = False
                if entry.watched:
                    with contextlib.suppress(OSError, ValueError):
                        self._epoll.unregister(entry.fd)
        self._hot = [entry for entry in self._hot if not entry.paused]
        if allowance.resume is None:
            self.pauses[tenant] = self.pauses.get(tenant, 0) + 1
            allowance.resume = self.call_later(allowance.wait(now), lambda: self._resume(tenant))

    def _resume(self, tenant: object) -> None:
        """Read a paused tenant's links again."""
        allowance = self._allowances.get(tenant)
        if allowance is not None:
            allowance.resume = None
        now = time.monotonic()
        for entry in self._by_link.values():
            if entry.tenant != tenant or not entry.paused:
                continue
            entry.paused = False
            if entry.watched:
                with contextlib.suppress(OSError, ValueError):
                    self._epoll.register(entry.fd, _EPOLLIN | (_EPOLLOUT if entry.writing else 0))
            entry.hot = True
            entry.last = now
            self._hot.append(entry)
            self._touched[entry] = None

    def _forget_allowances(self) -> None:
        """Drop the allowances of tenants without links whose tokens are all back."""
        if not self._allowances:
            return
        now = time.monotonic()
        tenants = {entry.tenant for entry in self._by_link.values()}
        for tenant, allowance in list(self._allowances.items()):
            if tenant not in tenants and allowance.resume is None and allowance.full(now):
                del self._allowances[tenant]
                self._low.pop(tenant, None)

    def _run_timers(self) -> None:
        timers = self._timers
        if not timers:
            return
        now = time.monotonic()
        while timers and timers[0][0] <= now:
            timer = heapq.heappop(timers)[2]
            if timer.cancelled:
                self._cancelled_timers -= 1
                continue
            try:
                timer.fn()
            except Exception:
                log.exception("a data-plane timer failed")

    def _finish_pass(self) -> None:
        touched, self._touched = self._touched, {}
        for entry in touched:
            if entry.removed:
                continue
            link = entry.link
            try:
                if link.error is not None:
                    link.poll(entry.owner.sink, POLL_BUDGET)  # report what the failure ended
                    entry.owner.link_failed()
                    self._unwatch(entry)
                entry.owner.end_pass()
                if not entry.polls and link.error is None:
                    self._settle(entry)
            except Exception:
                log.exception("finishing a data-plane pass failed")
            if self._gone(entry):
                continue
            if link.error is None and link.wants_write != entry.writing:
                entry.writing = link.wants_write
                if not entry.paused:  # out of the epoll set: `_resume` registers both
                    with contextlib.suppress(OSError, ValueError):
                        self._epoll.modify(entry.fd, _EPOLLIN | (_EPOLLOUT if entry.writing else 0))
        self._cool_down()

    def _settle(self, entry: _Entry) -> None:
        """End a readiness-driven link's pass now instead of in one more pass.

        Its owner's `end_pass` flushed what it queued, so a `wake` from inside it needs
        no further pass; sends that the flush finished are reported (`arm`) and acted on
        (`end_pass`) here, a few rounds at most. Without this every job that sent a
        COMPLETION cost an extra pass: an epoll wait, an empty read and a GIL hand-off.
        """
        link, owner = entry.link, entry.owner
        for _ in range(SETTLE_ROUNDS):
            if entry.removed:
                return
            if link.error is not None:
                self._touched[entry] = None  # the next pass reports the failure (once)
                return
            self._touched.pop(entry, None)
            if link.arm(owner.sink):
                return
            owner.end_pass()
        if not entry.removed:
            self._touched[entry] = None  # still busy: one more pass

    @staticmethod
    def _gone(entry: _Entry) -> bool:
        """Whether the entry was removed (its owner may remove it while it is served)."""
        return entry.removed

    def _adapt_spin(self, entry: _Entry) -> None:
        """A sleeping verbs link woke: poll it longer next time if it slept only briefly."""
        if not entry.polls or self.spin <= 0:
            return
        slept = time.monotonic() - entry.last
        longest = SPIN_GROWTH * self.spin
        entry.spin = 2 * slept if slept < longest else self.spin
        entry.spin = min(max(entry.spin, self.spin), longest)

    def _cool_down(self) -> None:
        """Stop polling links with nothing in flight once `spin` has passed (arm them)."""
        now = time.monotonic()
        keep: list[_Entry] = []
        for entry in self._hot:
            link = entry.link
            if entry.removed:
                continue
            if link.error is None:
                if link.backlog:  # frames it read wait (tcp): no readiness reports them
                    keep.append(entry)
                    continue
                if entry.polls and (
                    link.outstanding
                    or self.spin < 0
                    or now - entry.last < max(entry.spin, self.spin)
                ):
                    keep.append(entry)
                    continue
                if not link.arm(entry.owner.sink):  # a capsule slipped in: handled, go on
                    entry.last = now
                    self._touched[entry] = None
                    keep.append(entry)
                    continue
            entry.hot = False
        if len(keep) != len(self._hot):
            self._hot = keep

    def _check_overdue(self) -> None:
        """Once a second: fail tcp links whose host left a request unanswered too long."""
        now = time.monotonic()
        for entry in list(self._by_link.values()):
            if entry.link.error is None and entry.link.overdue(now):
                self._touched[entry] = None
        self._overdue_timer = (
            self.call_later(MAX_WAIT, self._check_overdue) if self._by_link else None
        )


def _set_result(future: asyncio.Future[_T], result: _T) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)

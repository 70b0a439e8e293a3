"""Worker threads that serve their callers in turn, not first come first served.

The reactor hands blocking storage calls and CPU-heavy job steps to worker threads.
A plain `concurrent.futures.ThreadPoolExecutor` has one FIFO queue: a session that
queues a hundred calls makes every other session's next call wait for all hundred. A
`FairPool` keeps one queue per key (the reactor's callers use their session) and its
workers take from the keys in turn, one call each: a key's call waits for the calls
already running and for at most one call of each other key that has some waiting,
never for another key's backlog. Calls of one key start in the order they came.

`submit` answers a `concurrent.futures.Future`; cancelling it before its call started
takes the call out of its queue at once (the call never runs). Workers start as calls
need them, up to `workers`, and are daemon threads: a call that never returns does
not hold the process at exit. `close` cancels every call not started, `join` waits
for the running ones.
"""

from __future__ import annotations

import collections
import concurrent.futures
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Final, TypeVar

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable

_T = TypeVar("_T")

_Queue = collections.OrderedDict["concurrent.futures.Future[Any]", "Callable[[], Any]"]
_STOP: Final = object()  # a token that ends the worker taking it


class FairPool:
    """Up to `workers` threads named `name`-N serving one queue per key in turn."""

    def __init__(self, workers: int, *, name: str) -> None:
        if workers < 1:
            raise ValueError("a pool needs at least one worker")
        self.workers = workers
        self.name = name
        self._lock = threading.Lock()
        # the keys that have calls waiting, in the order they are served next
        self._queues: collections.OrderedDict[Hashable, _Queue] = collections.OrderedDict()
        # one token per call submitted, and _STOP per worker once closed: an idle worker
        # blocks here, in C, which wakes it far sooner than a Condition (a token whose
        # call was cancelled finds nothing, or a later call: harmless)
        self._tokens: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._threads: set[threading.Thread] = set()
        self._started = 0  # threads started so far (for their names)
        self._idle = 0  # threads waiting for a token
        self._closed = False
        self.waiting = 0  # calls not started yet
        self.running = 0  # calls a worker runs now
        self.peak_waiting = 0  # the most calls that waited at once

    def submit(self, key: Hashable, fn: Callable[[], _T]) -> concurrent.futures.Future[_T]:
        """Run `fn()` on a worker when `key`'s turn comes; RuntimeError once shut down."""
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self.name} pool is shut down")
            queue = self._queues.get(key)
            if queue is None:
                queue = self._queues[key] = collections.OrderedDict()
            queue[future] = fn
            self.waiting += 1
            self.peak_waiting = max(self.peak_waiting, self.waiting)
            if self.waiting > self._idle and len(self._threads) < self.workers:
                self._start_worker()
        self._tokens.put(None)
        future.add_done_callback(lambda f: self._forget(key, f))
        return future

    @property
    def threads(self) -> int:
        """Worker threads alive."""
        with self._lock:
            return len(self._threads)

    def queued(self, key: Hashable) -> int:
        """How many calls of `key` wait (not started)."""
        with self._lock:
            queue = self._queues.get(key)
            return 0 if queue is None else len(queue)

    def shutdown(self, timeout: float | None = None) -> bool:
        """`close`, then `join`: True once every worker has ended."""
        self.close()
        return self.join(timeout)

    def close(self) -> None:
        """Take no more calls (`submit` raises RuntimeError); cancel those not started."""
        with self._lock:
            self._closed = True
            dropped = [future for queue in self._queues.values() for future in queue]
            self._queues.clear()
            self.waiting = 0
            for _ in self._threads:
                self._tokens.put(_STOP)
        for future in dropped:  # taken out of their queues here: notified here
            future.cancel()
            future.set_running_or_notify_cancel()

    def join(self, timeout: float | None = None) -> bool:
        """Wait at most `timeout` seconds (None: no limit) for the workers to end.

        After `close` they end once their running calls returned. True if all have.
        """
        with self._lock:
            threads = list(self._threads)
        end = None if timeout is None else time.monotonic() + timeout
        for thread in threads:
            thread.join(None if end is None else max(0.0, end - time.monotonic()))
        return not any(thread.is_alive() for thread in threads)

    # ------------------------------------------------------------ internals

    def _start_worker(self) -> None:
        """A new worker thread (the lock is held)."""
        self._started += 1
        thread = threading.Thread(
            target=self._work, name=f"{self.name}-{self._started}", daemon=True
        )
        self._threads.add(thread)
        thread.start()

    def _forget(self, key: Hashable, future: concurrent.futures.Future[Any]) -> None:
        """A call's future is done: if it was cancelled before it started, unqueue it."""
        if not future.cancelled():
            return
        with self._lock:
            queue = self._queues.get(key)
            if queue is None or queue.pop(future, None) is None:
                return  # a worker or `shutdown` took it already (and notifies it)
            self.waiting -= 1
            if not queue:
                del self._queues[key]
        future.set_running_or_notify_cancel()  # for `concurrent.futures.wait`: False

    def _next(self) -> tuple[concurrent.futures.Future[Any], Callable[[], Any]] | None:
        """The next call, the keys taken in turn (the lock is held)."""
        if not self._queues:
            return None  # the token of a call cancelled since
        key, calls = next(iter(self._queues.items()))
        call = calls.popitem(last=False)
        if calls:
            self._queues.move_to_end(key)  # its next call after one of each other key's
        else:
            del self._queues[key]
        self.waiting -= 1
        self.running += 1
        return call

    def _work(self) -> None:
        lock, tokens = self._lock, self._tokens
        with lock:
            self._idle += 1
        while True:
            token = tokens.get()
            with lock:
                self._idle -= 1
                if token is _STOP:
                    self._threads.discard(threading.current_thread())
                    return
                call = self._next()
                if call is None:
                    self._idle += 1
                    continue
            future, fn = call
            del call
            try:
                _run(future, fn)
            finally:
                del future, fn  # hold nothing of it while waiting for the next
                with lock:
                    self.running -= 1
                    self._idle += 1


def _run(future: concurrent.futures.Future[Any], fn: Callable[[], Any]) -> None:
    """Run a call unless it was cancelled; its result or exception goes to `future`."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn()
    except BaseException as exc:  # noqa: BLE001 - handed to the future, as an executor does
        future.set_exception(exc)
    else:
        future.set_result(result)

"""The reactor's timers: a cancelled one lets go of its call at once and leaves the heap."""

from __future__ import annotations

import functools
import gc
import threading
import weakref

from dpu_agent.dataplane.reactor import CANCELLED_TIMERS_KEPT, Reactor


class Payload:
    """Stands for what a timer's call holds (a throttled write's job and data)."""

    def run(self) -> None:
        pass


def test_cancelled_timers_free_what_they_hold_and_leave_the_heap():
    reactor = Reactor(spin=0.002)  # not started: this thread stands for the reactor's
    held = []
    timers = []
    for _ in range(10 * CANCELLED_TIMERS_KEPT):
        payload = Payload()
        held.append(weakref.ref(payload))
        timers.append(reactor.call_later(3600.0, payload.run))  # an hour away
    keep = reactor.call_later(3600.0, lambda: None)
    del payload
    for timer in timers:
        timer.cancel()
    gc.collect()
    assert [ref for ref in held if ref() is not None] == []  # nothing waits an hour
    entries = reactor._timers
    assert len(entries) <= 2 * CANCELLED_TIMERS_KEPT + 1
    assert any(entry[2] is keep for entry in entries)  # the live timer stays


def test_timers_run_in_order_while_others_are_cancelled_around_them():
    reactor = Reactor(spin=0.002)
    ran: list[int] = []
    done = threading.Event()
    timers = [reactor.call_later(0.001 * i, functools.partial(ran.append, i)) for i in range(300)]
    for i, timer in enumerate(timers):
        if i % 3:
            timer.cancel()  # two in three: the heap is compacted on the way
    assert len(reactor._timers) < 300
    reactor.call_later(0.4, done.set)
    reactor.start()
    try:
        assert done.wait(10)
    finally:
        reactor.stop()
    assert ran == list(range(0, 300, 3))

"""`[dataplane] reactor_cpus`: the reactor's thread runs on the CPUs it names, and only it."""

from __future__ import annotations

import os
import threading

from dpu_agent.dataplane.reactor import Reactor


def _affinity_on_the_reactor(reactor: Reactor) -> set[int]:
    seen: list[set[int]] = []
    done = threading.Event()

    def probe() -> None:
        seen.append(os.sched_getaffinity(0))  # pid 0: the calling thread
        done.set()

    reactor.call(probe)
    assert done.wait(10), "the reactor did not run the probe"
    return seen[0]


def test_the_reactor_thread_is_pinned_and_the_process_is_not():
    allowed = os.sched_getaffinity(0)
    cpu = max(allowed)
    reactor = Reactor(cpus=frozenset({cpu}))
    reactor.start()
    try:
        assert _affinity_on_the_reactor(reactor) == {cpu}
        assert os.sched_getaffinity(0) == allowed  # this thread, and the workers' default
    finally:
        reactor.stop()


def test_no_cpus_leaves_the_reactor_where_the_process_may_run():
    reactor = Reactor()
    reactor.start()
    try:
        assert _affinity_on_the_reactor(reactor) == os.sched_getaffinity(0)
    finally:
        reactor.stop()

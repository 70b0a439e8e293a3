"""A reactor serving one hot polled (verbs) link makes no epoll call per pass.

While that link is the only one and hot, an `epoll_wait` could report nothing the pass
does not see anyway, and in the test VM it took a third of a busy reactor's time. The
links here are stand-ins polled by the reactor (their capsules come from the test's
thread); the rxe runs are in tests/vm.
"""

from __future__ import annotations

import collections
import threading
from typing import TYPE_CHECKING

from dpu_agent.dataplane.reactor import Reactor
from dpu_wire.transport.base import LinkSink
from tests.links import StandInLink, StandInOwner

if TYPE_CHECKING:
    import select

CAPSULES = 200


class _PolledLink(StandInLink):
    """A verbs-like link: polled while hot, capsules pushed by another thread."""

    needs_polling = True

    def __init__(self) -> None:
        super().__init__()
        self.in_flight = 1  # as a link with work in flight: it stays hot
        self.inbound: collections.deque[bytes] = collections.deque()

    def poll(self, sink: LinkSink, budget: int) -> int:
        taken = 0
        while self.inbound and taken < budget:
            sink.on_capsule(memoryview(self.inbound.popleft()))
            taken += 1
        return taken


class _Owner(StandInOwner):
    def __init__(self, expected: int) -> None:
        self.got: list[bytes] = []
        self.all_in = threading.Event()
        self._expected = expected

    def on_capsule(self, data: memoryview) -> None:
        self.got.append(bytes(data))
        if len(self.got) == self._expected:
            self.all_in.set()


class _CountingEpoll:
    """The reactor's epoll, counting `poll` calls."""

    def __init__(self, epoll: select.epoll) -> None:
        self._epoll = epoll
        self.polls = 0

    def poll(self, timeout: float) -> list[tuple[int, int]]:
        self.polls += 1
        return self._epoll.poll(timeout)

    def __getattr__(self, name: str) -> object:
        return getattr(self._epoll, name)


def _feed(link: _PolledLink, count: int) -> None:
    for i in range(count):
        link.inbound.append(b"capsule %d" % i)
        if i % 20 == 0:
            threading.Event().wait(0.001)  # arrive over time, as over a wire


def test_one_hot_polled_link_is_served_without_an_epoll_per_pass():
    reactor = Reactor(spin=-1, compute_workers=1, io_workers=1)  # never cools down
    epoll = _CountingEpoll(reactor._epoll)
    reactor._epoll = epoll  # type: ignore[assignment]
    link, owner = _PolledLink(), _Owner(CAPSULES)
    added = threading.Event()
    reactor.start()
    try:

        def add() -> None:
            reactor.add(link, owner)
            added.set()

        reactor.call(add)
        assert added.wait(5)
        passes, polls = reactor.passes, epoll.polls
        _feed(link, CAPSULES)
        assert owner.all_in.wait(10), f"{len(owner.got)} of {CAPSULES} handed over"
        # calls from other threads still run: the inbox is read every pass
        ran = threading.Event()
        reactor.call(ran.set)
        assert ran.wait(5)
        alone_passes, alone_polls = reactor.passes - passes, epoll.polls - polls
        # a second link: epoll is asked again (its descriptor may have news)
        other = _PolledLink()
        reactor.call(lambda: reactor.add(other, _Owner(0)))
        before = epoll.polls
        threading.Event().wait(0.05)
        with_two = epoll.polls - before
    finally:
        reactor.stop(timeout=5)
        link.close()
        other.close()
    assert owner.got == [b"capsule %d" % i for i in range(CAPSULES)]
    assert alone_passes >= 20, alone_passes  # it did make passes meanwhile
    assert alone_polls == 0, f"{alone_polls} epoll calls in {alone_passes} passes"
    assert with_two > 0

"""A tenant's capsules that run no job spend an allowance a second; past it the reactor
stops reading the tenant's links until the allowance refills (`allowance.RESUME_AT`
capsules' worth). Nothing is dropped: the capsules wait in the link and are all handed
over in the end, in order, while other tenants' links are read as before.

The links are stand-ins holding a backlog (as a tcp link holds the frames one read
brought); a real agent and a hostile tcp host are in
tests/integration/test_refusal_allowance.py.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING, cast

import pytest

from dpu_agent import status
from dpu_agent.dataplane.allowance import RESUME_AT, Allowance
from dpu_agent.dataplane.pipeline import Pipeline
from dpu_agent.dataplane.reactor import POLL_BUDGET, Reactor
from dpu_agent.dataplane.regions import RegionTable
from dpu_wire import capsule
from dpu_wire.capsule import State
from dpu_wire.jobkinds import JobKind
from tests.links import (
    AgentEnd,
    BacklogLink,
    NoStaging,
    StandInHooks,
    StandInOwner,
    reactor,
    tcp_pair,
)

if TYPE_CHECKING:
    from dpu_agent.dataplane.pipeline import SessionHooks
    from dpu_agent.dataplane.staging import Staging

RATE = 200  # futile capsules a second, the tests' allowance


class _Owner(StandInOwner):
    """A session: records when each capsule came, and counts it futile if `refuses`."""

    def __init__(self, refuses: bool, total: int, done: threading.Event) -> None:
        self.refuses = refuses
        self.futile = 0
        self.got: list[tuple[float, bytes]] = []
        self._total = total
        self._done = done

    def on_capsule(self, data: memoryview) -> None:
        self.got.append((time.monotonic(), bytes(data)))
        if self.refuses:
            self.futile += 1
        if len(self.got) == self._total:
            self._done.set()


def test_the_allowance_refills_at_its_rate_up_to_one_second():
    allowance = Allowance(RATE, now=10.0)
    assert allowance.share(POLL_BUDGET, 10.0) == POLL_BUDGET  # a full second saved
    allowance.take(RATE + 3)
    assert allowance.spent
    assert allowance.share(POLL_BUDGET, 10.0) == 1  # never 0: a link polled gets one
    assert allowance.wait(10.0) == pytest.approx((RESUME_AT + 3) / RATE)
    assert allowance.refill(10.5) == pytest.approx(RATE / 2 - 3)
    assert allowance.refill(99.0) == RATE  # no more than a second's worth
    assert allowance.full(99.0)
    with pytest.raises(ValueError, match="below"):
        Allowance(RESUME_AT - 1, 0.0)
    with pytest.raises(ValueError, match="no limit"):  # not at the first add, on its thread
        Reactor(refusals_per_s=RESUME_AT - 1)


def _run(
    counts: dict[str, tuple[int, bool]], tenants: dict[str, str]
) -> tuple[dict[str, _Owner], dict[object, int], float]:
    """Add every link in one pass; wait until each owner has its capsules.

    `counts`: per link, its backlog and whether its owner counts them futile. Returns the
    owners, the reactor's pauses per tenant and when the links were added.
    """
    reactor = Reactor(spin=0.002, compute_workers=1, io_workers=1, refusals_per_s=RATE)
    links = {name: BacklogLink(name, count) for name, (count, _) in counts.items()}
    finished = {name: threading.Event() for name in links}
    owners = {
        name: _Owner(refuses, count, finished[name]) for name, (count, refuses) in counts.items()
    }
    started: list[float] = []
    reactor.start()
    try:

        def add_all() -> None:
            started.append(time.monotonic())
            for name, link in links.items():
                reactor.add(link, owners[name], tenants[name])

        reactor.call(add_all)
        for name, event in finished.items():
            assert event.wait(30), f"{name}: {len(owners[name].got)} handed over"
    finally:
        reactor.stop(timeout=5)
        for link in links.values():
            link.close()
    return owners, dict(reactor.pauses), started[0]


def test_a_tenants_futile_capsules_are_read_no_faster_than_its_allowance():
    """Tenant x floods two links with capsules that run no job, three seconds of its
    allowance; tenant y's link brings ordinary ones. y's are all handed over at once;
    x's come at most at the allowance's pace (a second's worth at the start, then
    `RATE` a second, overshooting by at most a pass), all of them, in order."""
    flood = 3 * RATE
    owners, pauses, start = _run(
        {"X1": (flood // 2, True), "X2": (flood // 2, True), "Y": (4 * POLL_BUDGET, False)},
        {"X1": "x", "X2": "x", "Y": "y"},
    )
    assert pauses.get("x", 0) >= 1
    assert "y" not in pauses
    for name in ("X1", "X2"):
        assert [data for _, data in owners[name].got] == [
            f"{name}{i}".encode() for i in range(flood // 2)
        ]
    x_times = sorted(t for name in ("X1", "X2") for t, _ in owners[name].got)
    y_last = owners["Y"].got[-1][0]
    assert sum(1 for t in x_times if t <= y_last) <= RATE + POLL_BUDGET  # y never waited
    for count, at in enumerate(x_times, start=1):  # the pace (a slower machine only slows it)
        assert count <= RATE + (at - start) * RATE + POLL_BUDGET, (count, at - start)


def test_a_tenant_that_sends_no_futile_capsules_is_never_paused():
    owners, pauses, _ = _run({"Y": (10 * RATE, False)}, {"Y": "y"})
    assert len(owners["Y"].got) == 10 * RATE
    assert pauses == {}


class _RefusingEnd(AgentEnd):
    """An agent end that counts every capsule futile, as a session refusing them would."""

    futile = 0

    def on_capsule(self, data: memoryview) -> None:
        self.futile += 1
        super().on_capsule(data)


@pytest.mark.asyncio
async def test_a_paused_tcp_link_is_not_read_and_does_not_spin_the_reactor():
    """Over a real socket: the host sends three seconds' worth of futile capsules at once.
    They all arrive, in order, at the allowance's pace; while the link waits its readable
    socket is out of the reactor's epoll set (else every pass would find it readable and
    the loop would spin: tens of thousands of passes a second)."""
    async with reactor(refusals_per_s=RATE) as r:
        host, refusing = await tcp_pair(r, end=_RefusingEnd)
        passes, start = r.passes, time.monotonic()
        count = 3 * RATE
        for i in range(count):
            host.send(b"futile %d" % i)
        for i in range(count):
            assert await refusing.recv() == b"futile %d" % i
        elapsed, passes = time.monotonic() - start, r.passes - passes
        assert sum(r.pauses.values()) >= 1
        assert passes < 100 * (elapsed + 1) + 2 * count / RESUME_AT, (passes, elapsed)
        await refusing.close()
        await host.close()


class _SubmittingLink(BacklogLink):
    """A link whose backlog is SUBMITs of a span nobody registered (each fails at
    admission: futile) and whose host never answers one READ (so a closing session
    drains it for up to `pipeline.CLOSE_DRAIN_S`)."""

    inline_max = 0

    def __init__(self, count: int) -> None:
        super().__init__("x", 0)
        unknown = capsule.Span(0x1000, 4096, 0xDEAD)
        self.waiting = [capsule.pack_submit(i, JobKind.CRC32C, unknown) for i in range(1, count)]
        self.in_flight = 1

    def room(self) -> int:
        return 1 << 20

    def post_send(self, message: bytes | memoryview, token: int | None = None) -> None:
        pass

    def fast_regions(self, _regions: object, _sink: object) -> bool:
        return False


def test_a_closing_session_reads_its_link_no_faster_than_its_tenants_allowance():
    """A closing session drains its link (for answers to its READs) outside the reactor's
    passes; that drain, too, must wait while the tenant is paused and charge what it
    reads. It used to read 64 capsules a millisecond whatever the allowance said."""
    r = Reactor(spin=0.002, compute_workers=1, io_workers=1, refusals_per_s=RATE)
    link = _SubmittingLink(100_000)
    pipe = Pipeline(
        hooks=cast("SessionHooks", StandInHooks()),
        link=link,
        reactor=r,
        staging=cast("Staging", NoStaging()),
        regions=RegionTable(),
        storage=None,
        queue_depth=4,
        default_deadline=30.0,
    )
    closed = threading.Event()
    at_close: list[tuple[int, float]] = []

    def close() -> None:
        at_close.append((len(link.waiting), time.monotonic()))
        pipe.close(State.CANCELLED, status.CANCELLED, "closed", closed.set)

    r.start()
    try:
        r.call(lambda: r.add(link, pipe, "x"))
        deadline = time.monotonic() + 10
        while not r.pauses.get("x") and time.monotonic() < deadline:
            time.sleep(0.001)
        assert r.pauses.get("x"), "the flood never spent the allowance"
        r.call(close)
        assert closed.wait(10)
        left, started = at_close[0]
        elapsed = time.monotonic() - started
        read = left - len(link.waiting)
        assert read <= RATE * elapsed + RESUME_AT + POLL_BUDGET, (read, elapsed)
    finally:
        r.stop(timeout=5)
        link.close()


class _CheckedLink(BacklogLink):
    """A link that counts the reactor's checks for requests its host left unanswered."""

    def __init__(self) -> None:
        super().__init__("checked", 0)
        self.checks = threading.Event()

    def overdue(self, now: float) -> bool:  # noqa: ARG002 - it only counts the calls
        self.checks.set()
        return False


def test_a_link_added_while_its_tenant_waits_is_still_checked_for_unanswered_requests():
    """The once-a-second check (a tcp host that leaves a READ unanswered fails its link)
    starts with the first link; a reactor whose first link came while its tenant was
    paused never started it, so no link was checked until another was added."""
    r = Reactor(spin=0.002, compute_workers=1, io_workers=1, refusals_per_s=RATE)
    link = _CheckedLink()

    def add_while_paused() -> None:
        allowance = r._allowances["x"] = Allowance(RATE, time.monotonic())
        allowance.take(RATE)
        allowance.resume = r.call_later(60, lambda: None)  # x waits for a minute
        r.add(link, StandInOwner(), "x")

    r.start()
    try:
        r.call(add_while_paused)
        assert link.checks.wait(5), "the link was never checked"
    finally:
        r.stop(timeout=5)
        link.close()


def test_a_pass_reads_no_more_links_of_a_tenant_once_it_has_spent_its_allowance():
    """64 links of tenant x, all flooding futile capsules. Once the tenant is down to the
    few tokens a resume brings, a pass split its budget among the 64 (at least one each)
    and read every link: 64 capsules, 8 tokens' worth, while other tenants waited behind
    them. The pass now stops at the link that spent the allowance: passes that read x
    read about `RESUME_AT` capsules, not one from each link."""
    links_n, each = POLL_BUDGET, 10
    total = links_n * each
    r = Reactor(spin=0.002, compute_workers=1, io_workers=1, refusals_per_s=RATE)
    passes: list[int] = []  # the reactor's pass number at each capsule handed over
    done = threading.Event()

    class Owner(StandInOwner):
        def on_capsule(self, data: memoryview) -> None:  # noqa: ARG002 - only counted
            self.futile += 1
            passes.append(r.passes)
            if len(passes) == total:
                done.set()

    links = [BacklogLink(f"X{i}-", each) for i in range(links_n)]
    r.start()
    try:

        def add_all() -> None:
            for link in links:
                r.add(link, Owner(), "x")

        r.call(add_all)
        assert done.wait(30), f"{len(passes)} of {total} handed over"
    finally:
        r.stop(timeout=5)
        for link in links:
            link.close()
    per_pass = sorted(collections.Counter(passes).values())
    assert per_pass[len(per_pass) // 2] <= POLL_BUDGET // 4, per_pass

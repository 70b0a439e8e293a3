"""The reactor serves hot links in turn, `POLL_BUDGET` each per pass, and polls a link
again by itself while it holds work it already took off the wire (`backlog`).

The links here are stand-ins that hold a backlog of capsules and hand over at most the
budget per poll, as a tcp link does with the frames one read of its socket brought; the
real tcp link's side is in test_tcp_transport.py.
"""

from __future__ import annotations

import itertools
import threading
from typing import TYPE_CHECKING

from dpu_agent.dataplane.reactor import POLL_BUDGET, Reactor
from tests.links import BacklogLink, StandInOwner

if TYPE_CHECKING:
    from collections.abc import Callable


class _Owner(StandInOwner):
    """A session: records which link each capsule came from, in the order handed over."""

    def __init__(self, name: str, order: list[str], done: Callable[[], None]) -> None:
        self.name = name
        self._order = order
        self._done = done

    def on_capsule(self, data: memoryview) -> None:
        assert bytes(data).startswith(self.name.encode())
        self._order.append(self.name)
        self._done()


def _handed_over(counts: dict[str, int], tenants: dict[str, str] | None = None) -> list[str]:
    """Each link's name, once per capsule the reactor handed over, in order.

    `counts`: each link's backlog, all added (and hot) in one pass, in this order;
    `tenants`: a link's tenant (else one of its own).
    """
    order: list[str] = []
    all_in = threading.Event()
    total = sum(counts.values())

    def done() -> None:
        if len(order) == total:
            all_in.set()

    reactor = Reactor(spin=0.002, compute_workers=1, io_workers=1)
    links = {name: BacklogLink(name, count) for name, count in counts.items()}
    owners = {name: _Owner(name, order, done) for name in links}
    reactor.start()
    try:

        def add_all() -> None:  # in one pass: all hot from the same one
            for name, link in links.items():
                reactor.add(link, owners[name], (tenants or {}).get(name))

        reactor.call(add_all)
        assert all_in.wait(10), f"stranded: {len(order)} of {total} handed over"
    finally:
        reactor.stop(timeout=5)
        for link in links.values():
            link.close()
    return order


def test_hot_links_take_turns_of_one_budget_and_no_capsule_is_stranded():
    """A: a backlog of ten budgets and a bit, B: three and a bit, both readable once.
    Each pass polls A, then B, a budget each: B never waits behind more than one budget
    of A's, and once B's backlog is gone A goes on alone until its own is. Every capsule
    is handed over although neither descriptor becomes readable again."""
    a_count, b_count = 10 * POLL_BUDGET + 5, 3 * POLL_BUDGET + 7
    order = _handed_over({"A": a_count, "B": b_count})
    runs = [(name, len(list(run))) for name, run in itertools.groupby(order)]
    assert runs == [("A", POLL_BUDGET), ("B", POLL_BUDGET)] * 3 + [
        ("A", POLL_BUDGET),
        ("B", 7),
        ("A", a_count - 4 * POLL_BUDGET),
    ]


def test_a_tenants_links_share_one_budget_a_pass():
    """Tenant x floods four links, tenant y one: each pass gives x's links a quarter of
    the budget each and y's link the whole of it, so opening more sessions gives a host
    no larger share of the reactor than any other tenant's."""
    names = ["A1", "A2", "A3", "A4"]
    counts = dict.fromkeys(names, POLL_BUDGET) | {"B": 3 * POLL_BUDGET}
    order = _handed_over(counts, {name: "y" if name == "B" else "x" for name in counts})
    quarter = POLL_BUDGET // len(names)
    runs = [(name, len(list(run))) for name, run in itertools.groupby(order)]
    a_pass = [(name, quarter) for name in names]
    assert runs == [*a_pass, ("B", POLL_BUDGET)] * 3 + a_pass

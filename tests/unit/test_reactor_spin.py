"""The reactor's adaptive polling window follows a link's traffic (unit test of the rule;
the polling modes themselves run over rxe in tests/vm)."""

from __future__ import annotations

import time
import types

import pytest

from dpu_agent.dataplane import reactor as reactor_mod
from dpu_agent.dataplane.reactor import SPIN_GROWTH, Reactor


@pytest.fixture
def reactor():
    loop = Reactor(spin=0.002)
    loop.start()
    yield loop
    loop.stop()


def _entry(slept: float, *, polls: bool = True) -> reactor_mod._Entry:
    link = types.SimpleNamespace()
    owner = types.SimpleNamespace()
    return reactor_mod._Entry(
        link=link,  # type: ignore[arg-type]
        owner=owner,
        fd=-1,
        polls=polls,
        hot=True,
        last=time.monotonic() - slept,
    )


@pytest.mark.parametrize(
    ("slept", "window"),
    [
        (0.0005, 0.002),  # shorter than spin: spin
        (0.005, 0.010),  # a few milliseconds: twice the sleep
        (0.0199, 0.020),  # near the cap: the cap
        (0.5, 0.002),  # a long sleep: back to spin
    ],
)
def test_a_link_woken_after_a_short_sleep_stays_polled_longer(reactor, slept, window):
    entry = _entry(slept)
    reactor._adapt_spin(entry)
    assert entry.spin == pytest.approx(window, rel=0.05)
    assert entry.spin <= SPIN_GROWTH * reactor.spin


def test_event_mode_and_tcp_links_keep_no_window(reactor):
    tcp = _entry(0.005, polls=False)
    reactor._adapt_spin(tcp)
    assert tcp.spin == 0.0
    reactor.spin = 0.0
    verbs = _entry(0.005)
    reactor._adapt_spin(verbs)
    assert verbs.spin == 0.0

"""`fairpool.FairPool`: worker threads that serve one queue per key in turn.

The reactor's compute and storage workers: a session's backlog of calls never delays
another session's next call by more than the calls already running (and one per
other waiting session).
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading

import pytest

from dpu_agent.dataplane.fairpool import FairPool
from dpu_agent.dataplane.reactor import Reactor

WAIT = 10.0  # seconds any one step may take before the test fails


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(name + "-")]


class _Gate:
    """A call that blocks its worker until `open()`."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self._open = threading.Event()

    def __call__(self) -> str:
        self.entered.set()
        assert self._open.wait(WAIT), "the gate was never opened"
        return "gate"

    def open(self) -> None:
        self._open.set()


@pytest.fixture
def pool():
    made = FairPool(1, name="test-fair")
    yield made
    assert made.shutdown(WAIT)
    assert made.threads == 0


def test_the_keys_are_served_in_turn_not_first_come_first_served(pool):
    """A key with ten calls waiting does not make another key's two wait behind them."""
    ran: list[str] = []
    gate = _Gate()
    pool.submit("gate", gate)
    assert gate.entered.wait(WAIT)  # the one worker is busy: everything below waits
    futures = [pool.submit("a", lambda n=n: ran.append(f"a{n}")) for n in range(10)]
    futures += [pool.submit("b", lambda n=n: ran.append(f"b{n}")) for n in range(2)]
    assert pool.waiting == 12
    assert pool.queued("a") == 10
    gate.open()
    concurrent.futures.wait(futures, WAIT)
    assert ran == ["a0", "b0", "a1", "b1", *(f"a{n}" for n in range(2, 10))]
    assert pool.waiting == 0
    assert pool.peak_waiting == 12


def test_a_new_key_waits_for_at_most_one_call_of_each_waiting_key(pool):
    ran: list[str] = []
    gate = _Gate()
    pool.submit("gate", gate)
    assert gate.entered.wait(WAIT)
    for key in ("a", "b", "c"):
        for n in range(100):
            pool.submit(key, lambda key=key, n=n: ran.append(f"{key}{n}"))
    last = pool.submit("late", lambda: ran.append("late"))
    gate.open()
    last.result(WAIT)
    assert ran[:4] == ["a0", "b0", "c0", "late"]


def test_a_keys_calls_run_in_the_order_they_came(pool):
    ran: list[int] = []
    futures = [pool.submit("a", functools.partial(ran.append, n)) for n in range(200)]
    concurrent.futures.wait(futures, WAIT)
    assert ran == list(range(200))


def test_workers_start_as_calls_need_them_up_to_the_limit():
    pool = FairPool(3, name="test-fair-grow")
    gates = [_Gate() for _ in range(5)]
    try:
        assert pool.threads == 0  # none before the first call
        for gate in gates:
            pool.submit("a", gate)
        assert all(gate.entered.wait(WAIT) for gate in gates[:3])
        assert pool.threads == 3
        assert len(_threads("test-fair-grow")) == 3
        assert pool.running == 3
        assert pool.waiting == 2
    finally:
        for gate in gates:
            gate.open()
        assert pool.shutdown(WAIT)


def test_an_exception_goes_to_the_future_and_the_worker_goes_on(pool):
    def broken() -> None:
        raise ValueError("a bad call")

    failed = pool.submit("a", broken)
    with pytest.raises(ValueError, match="a bad call"):
        failed.result(WAIT)
    assert pool.submit("a", lambda: 42).result(WAIT) == 42
    assert pool.threads == 1


def test_a_call_cancelled_before_it_started_never_runs_and_leaves_its_queue(pool):
    ran: list[str] = []
    gate = _Gate()
    pool.submit("gate", gate)
    assert gate.entered.wait(WAIT)
    dropped = pool.submit("a", lambda: ran.append("dropped"))
    kept = pool.submit("a", lambda: ran.append("kept"))
    done: list[bool] = []
    dropped.add_done_callback(lambda f: done.append(f.cancelled()))
    assert dropped.cancel()
    assert done == [True]  # its done callbacks ran at once
    assert concurrent.futures.wait([dropped], 0).done == {dropped}
    assert pool.queued("a") == 1
    assert pool.waiting == 1
    gate.open()
    kept.result(WAIT)
    assert ran == ["kept"]
    assert pool.waiting == 0


def test_a_running_call_cannot_be_cancelled(pool):
    gate = _Gate()
    running = pool.submit("a", gate)
    assert gate.entered.wait(WAIT)
    assert not running.cancel()
    gate.open()
    assert running.result(WAIT) == "gate"


def test_shutdown_drops_the_calls_not_started_and_waits_for_the_running_ones():
    pool = FairPool(1, name="test-fair-stop")
    ran: list[str] = []
    gate = _Gate()
    running = pool.submit("gate", gate)
    assert gate.entered.wait(WAIT)
    queued = [pool.submit("a", lambda: ran.append("late")) for _ in range(3)]
    assert not pool.shutdown(0.05)  # the gate still runs
    assert all(f.cancelled() for f in queued)
    assert pool.waiting == 0
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit("a", lambda: None)
    gate.open()
    assert pool.shutdown(WAIT)
    assert running.result(0) == "gate"
    assert ran == []
    assert pool.threads == 0


def test_the_reactor_stops_its_pools_and_drops_what_has_not_started():
    """`Reactor.stop`: no worker call starts after it, running ones finish, no thread stays."""
    reactor = Reactor(spin=0, compute_workers=1, io_workers=1)
    reactor.start()
    ran: list[str] = []
    gate = _Gate()
    done: list[concurrent.futures.Future[object]] = []
    reactor.io(gate, done.append, key="a")
    assert gate.entered.wait(WAIT)
    later = reactor.io(lambda: ran.append("io"), done.append, key="b")
    busy = _Gate()
    reactor.compute(busy, done.append, key="a")
    assert busy.entered.wait(WAIT)
    reactor.compute(lambda: ran.append("compute"), done.append, key="a")
    stopping = threading.Thread(target=reactor.stop, kwargs={"timeout": WAIT})
    stopping.start()
    assert concurrent.futures.wait([later], WAIT).done  # cancelled by the stop
    gate.open()
    busy.open()
    stopping.join(WAIT)
    assert not stopping.is_alive()
    assert later.cancelled()
    assert ran == []
    assert reactor._io.threads == reactor._compute.threads == 0

"""A reactor that dies of an exception calls its on_crash hook (the agent exits there)."""

import threading

import pytest

from dpu_agent.dataplane.reactor import Reactor


# the reactor's thread re-raises after the hook (in the agent the hook never returns)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_crash_is_logged_and_handed_to_on_crash(caplog):
    crashed: list[BaseException] = []
    seen = threading.Event()

    def on_crash(exc: BaseException) -> None:
        crashed.append(exc)
        seen.set()

    reactor = Reactor(spin=0, compute_workers=1, io_workers=1, on_crash=on_crash)
    original = reactor._run_timers

    def broken() -> None:
        original()
        raise RuntimeError("a bug in a pass")

    reactor._run_timers = broken  # type: ignore[method-assign]
    reactor.start()
    try:
        assert seen.wait(10), "on_crash was not called"
    finally:
        reactor.stop(timeout=5)
    assert [str(e) for e in crashed] == ["a bug in a pass"]
    assert "the data-plane reactor crashed" in caplog.text

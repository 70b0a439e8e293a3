"""`Session.attach`: handles are never reused, so the counter must stop at 2^32-1
(data-plane.md 1.4) instead of answering a handle a SUBMIT cannot carry."""

import itertools

import pytest

from dpu_agent.dataplane.session import Session, SessionState
from dpu_agent.errors import ResourceExhausted
from dpu_wire.capsule import U32_MAX


def _session(next_handle: int) -> Session:
    """A Session with only what `attach` reads (the rest needs a link and a reactor)."""
    session = Session.__new__(Session)
    session.name = "sessions/s-handles"
    session.state = SessionState.ACTIVE
    session.accepting = True
    session.error = None
    session._volumes = {}  # the fields attach uses
    session._handles = {}
    session._next_handle = itertools.count(next_handle)
    return session


def test_the_last_handle_is_given_and_the_one_past_it_refused():
    session = _session(U32_MAX)
    assert session.attach("vol-a") == U32_MAX
    assert session.attach("vol-a") == U32_MAX  # attached already: the same handle
    with pytest.raises(ResourceExhausted, match="used all 4294967295 volume handles"):
        session.attach("vol-b")
    assert session.volume_of(U32_MAX) == "vol-a"
    assert session.volume_of(U32_MAX + 1) is None


def test_a_detached_volume_attached_again_gets_a_new_handle():
    session = _session(1)
    first = session.attach("vol-a")
    session.detach("vol-a")
    assert session.volume_of(first) is None
    assert session.attach("vol-a") == first + 1

"""dpu_agent.stream_slots: the streams held without credentials, per connection and in all."""

import pytest

from dpu_agent.errors import ResourceExhausted
from dpu_agent.stream_slots import MAX_STREAMS, MAX_STREAMS_PER_PEER, StreamSlots


def test_one_connection_holds_at_most_its_share():
    slots = StreamSlots(total=100, per_peer=3)
    with slots.hold("a"), slots.hold("a"), slots.hold("a"):
        with pytest.raises(ResourceExhausted, match="this connection holds 3"), slots.hold("a"):
            pass
        with slots.hold("b"):  # another connection is not held back
            assert slots.open == 4
    assert slots.open == 0


def test_the_agent_holds_at_most_its_total_whatever_the_connections():
    slots = StreamSlots()
    holds = [slots.hold(f"ipv4:10.0.0.{i}:1") for i in range(MAX_STREAMS)]
    for hold in holds:
        hold.__enter__()
    with pytest.raises(ResourceExhausted, match=f"{MAX_STREAMS} streams"), slots.hold("new"):
        pass
    holds.pop().__exit__(None, None, None)
    with slots.hold("new"):  # a slot came back
        assert slots.open == MAX_STREAMS
    for hold in holds:
        hold.__exit__(None, None, None)
    assert slots.open == 0
    assert MAX_STREAMS_PER_PEER < MAX_STREAMS


def test_a_slot_comes_back_when_its_stream_fails():
    slots = StreamSlots(total=1, per_peer=1)
    with pytest.raises(RuntimeError), slots.hold("a"):
        raise RuntimeError
    with slots.hold("a"):
        assert slots.open == 1

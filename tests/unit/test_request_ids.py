"""The SDK's request ids: a new one per call, or the caller's."""

import asyncio
import re

import pytest

import host_client
from host_client import _request_ids


def test_a_call_without_one_gets_a_new_id_each_time():
    first, second = _request_ids.for_call(), _request_ids.for_call()
    assert re.fullmatch(r"[0-9a-f]{32}", first)
    assert first != second


def test_an_explicit_id_wins_over_the_block_and_blocks_nest():
    with host_client.request_id("outer"):
        assert _request_ids.for_call() == "outer"
        with host_client.request_id("inner"):
            assert _request_ids.for_call() == "inner"
            assert _request_ids.for_call("mine") == "mine"
        assert _request_ids.current() == "outer"
    assert _request_ids.current() == ""


@pytest.mark.asyncio
async def test_tasks_started_in_a_block_keep_its_id():
    async def call_later():
        await asyncio.sleep(0)  # runs after the block has ended
        return _request_ids.for_call()

    with host_client.request_id("trace-9"):
        task = asyncio.create_task(call_later())
    assert _request_ids.current() == ""
    assert await task == "trace-9"


@pytest.mark.parametrize("bad", ["", "x" * 129, "tab\there", "é"])
def test_ids_the_agent_cannot_carry_are_refused(bad):
    with pytest.raises(host_client.InvalidArgumentError, match="request id"):
        _request_ids.for_call(bad) if bad else _request_ids.check(bad)
    with pytest.raises(host_client.InvalidArgumentError), host_client.request_id(bad):
        pass

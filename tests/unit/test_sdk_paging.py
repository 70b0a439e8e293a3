"""The SDK follows an agent's page tokens to the end, and no further than bounds.

A faulty or hostile agent that never ends its listing (a repeated token, or fresh
tokens forever) gets InternalError instead of a list that grows until memory runs out.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, cast

import pytest

from dpu_agent import paging
from dpu_wire.v1 import network_pb2
from host_client import _rpc
from host_client._errors import InternalError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

pytestmark = pytest.mark.asyncio


class Agent:
    """ListFlowRules answering `size` rules a page, and the token `next_token(calls)`."""

    def __init__(self, size: int, next_token: Callable[[int], str]) -> None:
        self.size = size
        self.next_token = next_token
        self.calls = 0
        self.tokens: list[str] = []

    async def __call__(
        self, request: network_pb2.ListFlowRulesRequest, **_kwargs: object
    ) -> network_pb2.ListFlowRulesResponse:
        await asyncio.sleep(0)  # a real call suspends: lets a timeout fire
        self.calls += 1
        self.tokens.append(request.page_token)
        rules = [
            network_pb2.FlowRule(name=f"flowRules/r{self.calls}-{i}") for i in range(self.size)
        ]
        return network_pb2.ListFlowRulesResponse(
            flow_rules=rules, next_page_token=self.next_token(self.calls)
        )


async def _list(agent: Agent) -> list[network_pb2.FlowRule]:
    rpc = _rpc.Rpc(cast("_rpc.Stubs", None), timeout=1.0)

    def items(page: network_pb2.ListFlowRulesResponse) -> Iterable[network_pb2.FlowRule]:
        return page.flow_rules

    async with asyncio.timeout(10):  # the old code never returned
        return await rpc.all_pages(
            agent, lambda token: network_pb2.ListFlowRulesRequest(page_token=token), items
        )


async def test_every_page_until_an_empty_token() -> None:
    agent = Agent(3, lambda calls: f"t{calls}" if calls < 4 else "")
    rules = await _list(agent)
    assert len(rules) == 12
    assert agent.tokens == ["", "t1", "t2", "t3"]


async def test_a_repeated_token_stops_at_once() -> None:
    agent = Agent(1, lambda _calls: "again")
    with pytest.raises(InternalError, match="answered page token 'again' twice"):
        await _list(agent)
    assert agent.calls == 2


async def test_a_token_cycle_stops_when_it_comes_round() -> None:
    agent = Agent(1, lambda calls: ("a", "b", "c")[calls % 3])
    with pytest.raises(InternalError, match="does not end"):
        await _list(agent)
    assert agent.calls == 4  # answers b, c, a, b: b again


async def test_fresh_tokens_forever_stop_at_the_page_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_rpc, "MAX_PAGES", 50)
    agent = Agent(0, lambda calls: f"t{calls}")
    with pytest.raises(InternalError, match="past 50 pages"):
        await _list(agent)
    assert agent.calls == 50


async def test_fresh_tokens_forever_stop_at_the_item_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_rpc, "MAX_ITEMS", 1_000)
    agent = Agent(500, lambda calls: f"t{calls}")
    with pytest.raises(InternalError, match="past 1,000 items"):
        await _list(agent)
    assert agent.calls == 3


async def test_the_bounds_fit_the_api() -> None:
    # the SDK asks no page size: the agent's default; its largest pages end at the item bound
    assert _rpc.MAX_PAGES * paging.DEFAULT_PAGE_SIZE == _rpc.MAX_ITEMS
    assert _rpc.MAX_PAGES * paging.MAX_PAGE_SIZE > _rpc.MAX_ITEMS

"""NetworkService answers, called directly on the in-memory datapath (no gRPC)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from dpu_agent import auth
from dpu_agent.auth import Principal
from dpu_agent.errors import NotFound
from dpu_agent.network.memory_backend import MemoryFlowBackend
from dpu_agent.network.rulestore import RuleStore
from dpu_agent.network.table import FlowTable
from dpu_agent.services.network import NetworkService
from dpu_wire.v1 import network_pb2

T = TypeVar("T")
ADMIN = Principal("ops", admin=True)
CONTEXT: Any = None  # the service reads nothing from the gRPC context in these calls


def call(principal: Principal, rpc: Callable[[], Awaitable[T]]) -> T:
    async def run() -> T:
        auth.principal.set(principal)
        return await rpc()

    return asyncio.run(run())


@pytest.fixture
def table(tmp_path: Path) -> FlowTable:
    table = FlowTable(MemoryFlowBackend(), RuleStore(tmp_path / "rules.json"))
    table.start()
    return table


def test_get_port_of_a_port_the_agent_does_not_manage_is_not_found(table: FlowTable) -> None:
    service = NetworkService(table)
    got = call(ADMIN, lambda: service.GetPort(network_pb2.GetPortRequest(name="ports/p0"), CONTEXT))
    assert got.name == "ports/p0"
    request = network_pb2.GetPortRequest(name="ports/nope")
    with pytest.raises(NotFound, match=r"^ports/nope does not exist$"):
        call(ADMIN, lambda: service.GetPort(request, CONTEXT))

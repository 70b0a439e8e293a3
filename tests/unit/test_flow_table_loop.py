"""The NetworkService never waits for the flow table's lock on the event loop.

The table holds its lock while the datapath is programmed (tc) and the rule file is
written and synced; a read of the table on the event loop (the quota count of a
create, a list, a counters watch) stopped every call of every tenant for that long.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest

from dpu_agent import auth
from dpu_agent.network.memory_backend import MemoryFlowBackend
from dpu_agent.network.model import FlowRule
from dpu_agent.network.rulestore import RuleStore
from dpu_agent.network.table import FlowTable
from dpu_agent.services.network import NetworkService
from dpu_wire.v1 import network_pb2

CONTEXT: Any = None
SLOW_S = 2.0  # the longest the datapath keeps the table's lock (it is released sooner)


class _StuckBackend(MemoryFlowBackend):
    """A datapath whose install takes until `release` is set (or SLOW_S)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def install(self, rule: FlowRule) -> None:
        self.entered.set()
        self.release.wait(SLOW_S)
        super().install(rule)


def _as(principal: auth.Principal) -> contextvars.Context:
    context = contextvars.copy_context()
    context.run(auth.principal.set, principal)
    return context


@pytest.mark.asyncio
@pytest.mark.parametrize("call", ["list", "create", "apply"])
async def test_the_event_loop_runs_while_the_datapath_holds_the_table(
    tmp_path: Path, call: str
) -> None:
    backend = _StuckBackend()
    table = FlowTable(backend, RuleStore(tmp_path / "rules.json"))
    table.start()
    service = NetworkService(table)
    loop = asyncio.get_running_loop()
    admin = auth.Principal("ops", admin=True)
    rule = network_pb2.FlowRule(
        priority=10,
        ingress_port="ports/p0",
        actions=[network_pb2.FlowAction(drop=network_pb2.DropAction())],
    )
    request = network_pb2.CreateFlowRuleRequest(flow_rule_id="slow", flow_rule=rule)
    slow = loop.create_task(service.CreateFlowRule(request, CONTEXT), context=_as(admin))
    await loop.run_in_executor(None, backend.entered.wait, 10)  # the table's lock is held
    other = auth.Principal("tenant-b")
    reader: Coroutine[Any, Any, object]
    if call == "list":
        reader = service.ListFlowRules(network_pb2.ListFlowRulesRequest(), CONTEXT)
    elif call == "create":  # another tenant's create: its quota count reads the table
        other_rule = network_pb2.FlowRule(priority=1010, ingress_port="ports/p0")
        create = network_pb2.CreateFlowRuleRequest(flow_rule_id="b", flow_rule=other_rule)
        reader = NetworkService(table).CreateFlowRule(create, CONTEXT)
    else:
        reader = NetworkService(table).ApplyFlowRules(
            network_pb2.ApplyFlowRulesRequest(validate_only=True), CONTEXT
        )
    start = time.monotonic()
    waiting = loop.create_task(reader, context=_as(other))
    try:
        await asyncio.sleep(0.01)  # the reader starts, and comes to the table
        delay = time.monotonic() - start - 0.01
        assert delay < 0.5, f"the event loop stood still for {delay:.2f} s"
    finally:
        backend.release.set()
        await slow
        await asyncio.gather(waiting, return_exceptions=True)

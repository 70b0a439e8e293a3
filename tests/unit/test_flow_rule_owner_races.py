"""A flow rule id can change hands between the service's ownership check and the act.

The service reads a rule, checks the caller may touch it, and then asks the table to
delete or replace the rule of that id. Meanwhile the rule may be deleted and another
tenant's created under the same id. These tests make that happen deterministically
(the table's `get`, which the service checks with, swaps the rule right after it
answers) and require NOT_FOUND, with a missing rule's text, and the other tenant's
rule untouched.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dpu_agent import auth
from dpu_agent.auth import Principal
from dpu_agent.errors import NotFound
from dpu_agent.network import model
from dpu_agent.network.memory_backend import MemoryFlowBackend
from dpu_agent.network.rulestore import RuleStore
from dpu_agent.network.table import Changes, FlowTable
from dpu_agent.services.network import NetworkService
from dpu_wire.v1 import network_pb2

A = Principal("tenant-a")
B_RULE = model.FlowRule("x", 7, "pf0vf1", model.FlowMatch(), (model.Count(),), tenant="tenant-b")
CONTEXT: Any = None  # the service reads nothing from the gRPC context in these calls


def a_rule(priority: int = 1) -> model.FlowRule:
    return model.FlowRule(
        "x", priority, "pf0vf0", model.FlowMatch(), (model.Count(),), tenant="tenant-a"
    )


@pytest.fixture
def table(tmp_path: Path) -> FlowTable:
    table = FlowTable(MemoryFlowBackend(), RuleStore(tmp_path / "rules.json"))
    table.start()
    table.create(a_rule())
    return table


def swap_after_first_get(table: FlowTable, monkeypatch: pytest.MonkeyPatch) -> None:
    """After `get` first answers, tenant-a's rule x goes and tenant-b's x comes."""
    real: Callable[[str], model.FlowRule] = table.get
    swapped = False

    def get(rule_id: str) -> model.FlowRule:
        nonlocal swapped
        found = real(rule_id)
        if not swapped:
            swapped = True
            table.delete("x")
            table.create(B_RULE)
        return found

    monkeypatch.setattr(table, "get", get)


def as_tenant_a(call: Callable[[], Any]) -> Any:
    async def run() -> Any:
        auth.principal.set(A)
        return await call()

    return asyncio.run(run())


def assert_b_keeps_x(table: FlowTable) -> None:
    assert [(r.rule_id, r.tenant, r.priority) for r in table.rules()] == [("x", "tenant-b", 7)]


def _update_of_x() -> network_pb2.FlowRule:
    update = network_pb2.FlowRule(name="flowRules/x", ingress_port="ports/pf0vf0", priority=1002)
    update.actions.add().count.SetInParent()
    return update


CALLS_ON_X = {
    "DeleteFlowRule": lambda: network_pb2.DeleteFlowRuleRequest(name="flowRules/x"),
    "UpdateFlowRule": lambda: network_pb2.UpdateFlowRuleRequest(flow_rule=_update_of_x()),
    "ApplyFlowRules (deletes)": lambda: network_pb2.ApplyFlowRulesRequest(deletes=["flowRules/x"]),
    "ApplyFlowRules (updates)": lambda: network_pb2.ApplyFlowRulesRequest(updates=[_update_of_x()]),
    "GetFlowRule": lambda: network_pb2.GetFlowRuleRequest(name="flowRules/x"),
}


@pytest.mark.parametrize("call", CALLS_ON_X)
def test_a_call_on_a_rule_that_changed_hands_is_not_found(
    table: FlowTable, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    """Delete, update (alone or in bulk) and read: B's rule is neither changed nor read."""
    service = NetworkService(table)
    swap_after_first_get(table, monkeypatch)
    method = getattr(service, call.split(maxsplit=1)[0])
    request = CALLS_ON_X[call]()
    with pytest.raises(NotFound, match=r"^flowRules/x does not exist$"):
        as_tenant_a(lambda: method(request, CONTEXT))
    assert_b_keeps_x(table)


# ------------------------------------------------------------------ the table's own checks


def test_the_table_checks_the_owner_under_its_lock(table: FlowTable) -> None:
    table.delete("x")
    table.create(B_RULE)
    for act in (
        lambda: table.delete("x", "tenant-a"),
        lambda: table.update(a_rule(2)),  # an update never changes a rule's tenant
        lambda: table.apply(Changes(delete=("x",)), owners={"x": "tenant-a"}),
        lambda: table.apply(Changes(update=(a_rule(2),))),
        lambda: table.counters("x", "tenant-a"),
    ):
        with pytest.raises(NotFound, match=r"^flowRules/x does not exist$"):
            act()
    assert_b_keeps_x(table)
    assert table.counters_many(["x"], "tenant-a") == {}
    assert set(table.counters_many(["x"], "tenant-b")) == {"x"}
    assert set(table.counters_many(["x"])) == {"x"}
    table.delete("x", "tenant-b")
    assert table.rules() == []

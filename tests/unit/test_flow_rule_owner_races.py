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


def test_delete_of_a_rule_that_changed_hands_is_not_found(
    table: FlowTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = NetworkService(table)
    swap_after_first_get(table, monkeypatch)
    request = network_pb2.DeleteFlowRuleRequest(name="flowRules/x")
    with pytest.raises(NotFound, match=r"^flowRules/x does not exist$"):
        as_tenant_a(lambda: service.DeleteFlowRule(request, CONTEXT))
    assert_b_keeps_x(table)


def test_update_of_a_rule_that_changed_hands_is_not_found(
    table: FlowTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = NetworkService(table)
    swap_after_first_get(table, monkeypatch)
    incoming = network_pb2.FlowRule(name="flowRules/x", ingress_port="ports/pf0vf0", priority=2)
    incoming.actions.add().count.SetInParent()
    request = network_pb2.UpdateFlowRuleRequest(flow_rule=incoming)
    with pytest.raises(NotFound, match=r"^flowRules/x does not exist$"):
        as_tenant_a(lambda: service.UpdateFlowRule(request, CONTEXT))
    assert_b_keeps_x(table)


@pytest.mark.parametrize("what", ["deletes", "updates"])
def test_a_bulk_change_of_a_rule_that_changed_hands_is_not_found(
    table: FlowTable, monkeypatch: pytest.MonkeyPatch, what: str
) -> None:
    service = NetworkService(table)
    swap_after_first_get(table, monkeypatch)
    if what == "deletes":
        request = network_pb2.ApplyFlowRulesRequest(deletes=["flowRules/x"])
    else:
        update = network_pb2.FlowRule(name="flowRules/x", ingress_port="ports/pf0vf0", priority=2)
        update.actions.add().count.SetInParent()
        request = network_pb2.ApplyFlowRulesRequest(updates=[update])
    with pytest.raises(NotFound, match=r"^flowRules/x does not exist$"):
        as_tenant_a(lambda: service.ApplyFlowRules(request, CONTEXT))
    assert_b_keeps_x(table)


def test_reading_a_rule_that_changed_hands_does_not_give_its_counters(
    table: FlowTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = NetworkService(table)
    swap_after_first_get(table, monkeypatch)
    request = network_pb2.GetFlowRuleRequest(name="flowRules/x")
    with pytest.raises(NotFound, match=r"^flowRules/x does not exist$"):
        as_tenant_a(lambda: service.GetFlowRule(request, CONTEXT))


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

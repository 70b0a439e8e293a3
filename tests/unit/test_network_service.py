"""NetworkService answers, called directly on the in-memory datapath (no gRPC)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from dpu_agent import auth
from dpu_agent.auth import Principal
from dpu_agent.errors import InvalidArgument, NotFound, PermissionDenied
from dpu_agent.network import model
from dpu_agent.network.memory_backend import MemoryFlowBackend
from dpu_agent.network.rulestore import RuleStore
from dpu_agent.network.table import FlowTable
from dpu_agent.services.network import NetworkService
from dpu_agent.virtualization.manager import FunctionManager
from dpu_agent.virtualization.memory_backend import MemoryFunctionBackend
from dpu_agent.virtualization.model import FunctionSpec, FunctionType
from dpu_agent.virtualization.store import FunctionStore
from dpu_wire.v1 import network_pb2

T = TypeVar("T")
ADMIN = Principal("ops", admin=True)
A = Principal("tenant-a")
B = Principal("tenant-b")
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


def test_a_representor_port_names_its_function(table: FlowTable, tmp_path: Path) -> None:
    functions = FunctionManager(
        MemoryFunctionBackend(), FunctionStore(tmp_path / "f.json"), flow_rules=table.rules
    )
    functions.start()
    functions.create(FunctionSpec("a-fn", FunctionType.VF, tenant="tenant-a"))
    service = NetworkService(table, owners=functions)
    listed = call(ADMIN, lambda: service.ListPorts(network_pb2.ListPortsRequest(), CONTEXT))
    assert {p.name: p.function for p in listed.ports} == {
        "ports/p0": "",
        "ports/pf0vf0": "functions/a-fn",  # the memory backend's first representor
        "ports/pf0vf1": "",
        "ports/pf0vf2": "",
    }
    request = network_pb2.GetPortRequest(name="ports/pf0vf0")
    assert call(ADMIN, lambda: service.GetPort(request, CONTEXT)).function == "functions/a-fn"
    functions.delete("a-fn")
    assert call(ADMIN, lambda: service.GetPort(request, CONTEXT)).function == ""
    without_functions = NetworkService(table)
    assert call(ADMIN, lambda: without_functions.GetPort(request, CONTEXT)).function == ""


def test_a_flow_rule_carries_no_times_as_documented(table: FlowTable) -> None:
    """network.proto: FlowRule.times is not set (the agent keeps no times of rules)."""
    service = NetworkService(table)
    rule = network_pb2.FlowRule(ingress_port="ports/pf0vf0", priority=1000)
    rule.actions.add().count.SetInParent()
    create = network_pb2.CreateFlowRuleRequest(flow_rule_id="r1", flow_rule=rule)
    made = call(A, lambda: service.CreateFlowRule(create, CONTEXT))
    got = call(
        A, lambda: service.GetFlowRule(network_pb2.GetFlowRuleRequest(name=made.name), CONTEXT)
    )
    assert not made.HasField("times")
    assert not got.HasField("times")


def count_rule(name: str, port: str, priority: int) -> network_pb2.FlowRule:
    rule = network_pb2.FlowRule(name=name, ingress_port=port, priority=priority)
    rule.actions.add().count.SetInParent()
    return rule


def test_an_update_without_a_mask_may_not_move_the_rule(table: FlowTable) -> None:
    """No mask replaces the rule (AIP-134); its ingress port cannot change, so it is refused."""
    service = NetworkService(table)
    create = network_pb2.CreateFlowRuleRequest(
        flow_rule_id="r1", flow_rule=count_rule("", "ports/pf0vf0", 1010)
    )
    call(A, lambda: service.CreateFlowRule(create, CONTEXT))

    def update(principal: Principal, port: str, priority: int) -> network_pb2.FlowRule:
        request = network_pb2.UpdateFlowRuleRequest(
            flow_rule=count_rule("flowRules/r1", port, priority)
        )
        return call(principal, lambda: service.UpdateFlowRule(request, CONTEXT))

    with pytest.raises(InvalidArgument, match="ingress port of flowRules/r1 cannot change"):
        update(A, "ports/pf0vf1", 1011)
    with pytest.raises(NotFound, match=r"^flowRules/r1 does not exist$"):  # not a hint
        update(B, "ports/pf0vf1", 1011)
    assert [(r.ingress_port, r.priority) for r in table.rules()] == [("pf0vf0", 1010)]
    assert update(A, "ports/pf0vf0", 1011).ingress_port == "ports/pf0vf0"  # the same port
    assert update(A, "", 1012).ingress_port == "ports/pf0vf0"  # none given: kept
    assert [(r.ingress_port, r.priority) for r in table.rules()] == [("pf0vf0", 1012)]


def push_rule(name: str, vlan_id: int, priority: int = 1010) -> network_pb2.FlowRule:
    rule = network_pb2.FlowRule(name=name, ingress_port="ports/pf0vf0", priority=priority)
    rule.actions.add().vlan_push.vlan_id = vlan_id
    rule.actions.add().forward.port = "ports/p0"
    return rule


def test_every_call_that_takes_a_rule_checks_its_tags(table: FlowTable, tmp_path: Path) -> None:
    """Create, update and bulk apply refuse a VLAN the tenant was not granted, and change
    nothing; a tenant without a grant (no tags file: every tenant) pushes none."""
    functions = FunctionManager(
        MemoryFunctionBackend(), FunctionStore(tmp_path / "f.json"), flow_rules=table.rules
    )
    functions.start()
    functions.create(FunctionSpec("a-fn", FunctionType.VF, tenant="tenant-a"))  # pf0vf0
    service = NetworkService(table, owners=functions)
    create = network_pb2.CreateFlowRuleRequest(flow_rule_id="r1", flow_rule=push_rule("", 100))
    with pytest.raises(PermissionDenied, match="VLAN 100 is not granted to tenant 'tenant-a'"):
        call(A, lambda: service.CreateFlowRule(create, CONTEXT))
    bulk = network_pb2.ApplyFlowRulesRequest(
        creates=[count_rule("flowRules/ok", "ports/pf0vf0", 1001), push_rule("flowRules/r2", 100)]
    )
    with pytest.raises(PermissionDenied, match="VLAN 100 is not granted"):
        call(A, lambda: service.ApplyFlowRules(bulk, CONTEXT))
    assert table.rules() == []
    call(ADMIN, lambda: service.CreateFlowRule(create, CONTEXT))  # the admin: any tag
    assert [r.rule_id for r in table.rules()] == ["r1"]
    mine = network_pb2.CreateFlowRuleRequest(
        flow_rule_id="a1", flow_rule=count_rule("", "ports/pf0vf0", 1005)
    )
    call(A, lambda: service.CreateFlowRule(mine, CONTEXT))
    update = network_pb2.UpdateFlowRuleRequest(flow_rule=push_rule("flowRules/a1", 100, 1005))
    with pytest.raises(PermissionDenied, match="VLAN 100 is not granted"):
        call(A, lambda: service.UpdateFlowRule(update, CONTEXT))
    bulk_update = network_pb2.ApplyFlowRulesRequest(updates=[push_rule("flowRules/a1", 100, 1005)])
    with pytest.raises(PermissionDenied, match="VLAN 100 is not granted"):
        call(A, lambda: service.ApplyFlowRules(bulk_update, CONTEXT))
    assert table.get("a1").actions == (model.Count(),)  # unchanged


def test_a_granted_tag_is_the_tenants_to_push(table: FlowTable, tmp_path: Path) -> None:
    from dpu_agent.network import tags  # noqa: PLC0415 - new with the grants

    functions = FunctionManager(
        MemoryFunctionBackend(), FunctionStore(tmp_path / "f.json"), flow_rules=table.rules
    )
    functions.start()
    functions.create(FunctionSpec("a-fn", FunctionType.VF, tenant="tenant-a"))  # pf0vf0
    granted = tags.parse({"tenant": {"tenant-a": {"vlans": ["200-299"]}}}, "test")
    service = NetworkService(table, owners=functions, tags=granted)
    create = network_pb2.CreateFlowRuleRequest(flow_rule_id="r1", flow_rule=push_rule("", 250))
    assert call(A, lambda: service.CreateFlowRule(create, CONTEXT)).name == "flowRules/r1"
    update = network_pb2.UpdateFlowRuleRequest(flow_rule=push_rule("flowRules/r1", 300))
    with pytest.raises(PermissionDenied, match="VLAN 300 is not granted"):
        call(A, lambda: service.UpdateFlowRule(update, CONTEXT))
    update = network_pb2.UpdateFlowRuleRequest(flow_rule=push_rule("flowRules/r1", 299))
    call(A, lambda: service.UpdateFlowRule(update, CONTEXT))
    bulk = network_pb2.ApplyFlowRulesRequest(creates=[push_rule("flowRules/r2", 200, 1011)])
    call(A, lambda: service.ApplyFlowRules(bulk, CONTEXT))
    assert [r.rule_id for r in table.rules()] == ["r1", "r2"]


def test_every_call_that_takes_a_rule_keeps_a_tenant_out_of_the_admins_priorities(
    table: FlowTable,
) -> None:
    """An admin's rate limit at priority 10 on a tenant's representor was bypassed by the
    tenant's forward at 5. Create, update and bulk apply refuse a tenant's priority below
    1000 and change nothing; the admin's is accepted."""
    service = NetworkService(table)
    police = network_pb2.FlowRule(ingress_port="ports/pf0vf0", priority=10)
    police.actions.add().police.rate_bps = 10**6
    police.actions[0].police.burst_bytes = 10_000
    made = network_pb2.CreateFlowRuleRequest(flow_rule_id="ops-limit", flow_rule=police)
    call(ADMIN, lambda: service.CreateFlowRule(made, CONTEXT))  # the admin's band
    under = network_pb2.CreateFlowRuleRequest(
        flow_rule_id="a1", flow_rule=count_rule("", "ports/pf0vf0", 5)
    )
    with pytest.raises(PermissionDenied, match=r"^priority 5: 1\.\.999 are the admin role's"):
        call(A, lambda: service.CreateFlowRule(under, CONTEXT))
    bulk = network_pb2.ApplyFlowRulesRequest(
        creates=[
            count_rule("flowRules/ok", "ports/pf0vf0", 1001),
            count_rule("flowRules/a2", "ports/pf0vf0", 999),
        ]
    )
    with pytest.raises(PermissionDenied, match="priority 999: "):
        call(A, lambda: service.ApplyFlowRules(bulk, CONTEXT))
    assert [r.rule_id for r in table.rules()] == ["ops-limit"]
    mine = network_pb2.CreateFlowRuleRequest(
        flow_rule_id="a1", flow_rule=count_rule("", "ports/pf0vf0", 1000)
    )
    call(A, lambda: service.CreateFlowRule(mine, CONTEXT))
    update = network_pb2.UpdateFlowRuleRequest(flow_rule=count_rule("flowRules/a1", "", 9))
    with pytest.raises(PermissionDenied, match="priority 9: "):
        call(A, lambda: service.UpdateFlowRule(update, CONTEXT))
    bulk_update = network_pb2.ApplyFlowRulesRequest(
        updates=[count_rule("flowRules/a1", "ports/pf0vf0", 9)]
    )
    with pytest.raises(PermissionDenied, match="priority 9: "):
        call(A, lambda: service.ApplyFlowRules(bulk_update, CONTEXT))
    assert table.get("a1").priority == 1000  # unchanged


def test_a_tenants_rule_saved_below_the_band_moves_into_it_when_changed(table: FlowTable) -> None:
    """A rule saved before the band keeps its priority; a change must move it up."""
    table.create(
        model.FlowRule("old", 5, "pf0vf0", model.FlowMatch(), (model.Drop(),), tenant="tenant-a")
    )
    service = NetworkService(table)
    keep = network_pb2.UpdateFlowRuleRequest(flow_rule=count_rule("flowRules/old", "", 5))
    keep.update_mask.paths.append("actions")  # the priority stays 5
    with pytest.raises(PermissionDenied, match="priority 5: "):
        call(A, lambda: service.UpdateFlowRule(keep, CONTEXT))
    move = network_pb2.UpdateFlowRuleRequest(flow_rule=count_rule("flowRules/old", "", 1005))
    assert call(A, lambda: service.UpdateFlowRule(move, CONTEXT)).priority == 1005


def forward_rule(
    name: str, priority: int = 1010, vlan_id: int | None = None
) -> network_pb2.FlowRule:
    rule = network_pb2.FlowRule(name=name, ingress_port="ports/pf0vf0", priority=priority)
    if vlan_id is not None:
        rule.match.vlan_id = vlan_id
    rule.actions.add().forward.port = "ports/p0"
    return rule


def test_every_call_that_takes_a_rule_keeps_a_tenants_frames_off_the_uplinks_untagged(
    table: FlowTable, tmp_path: Path
) -> None:
    """A's forward of its own untagged frames to p0 put them on the uplink's native
    segment; of frames it tagged 100 itself, into B's VLAN. Create, update and bulk apply
    refuse both and change nothing; a granted push, or untagged = true, lets them through."""
    from dpu_agent.network import tags  # noqa: PLC0415 - new with the grants

    functions = FunctionManager(
        MemoryFunctionBackend(), FunctionStore(tmp_path / "f.json"), flow_rules=table.rules
    )
    functions.start()
    functions.create(FunctionSpec("a-fn", FunctionType.VF, tenant="tenant-a"))  # pf0vf0
    granted = tags.parse({"tenant": {"tenant-a": {"vlans": ["200-299"]}}}, "test")
    service = NetworkService(table, owners=functions, tags=granted)
    for refused, what in (
        (forward_rule(""), "in no VLAN"),
        (forward_rule("", 1010, 100), "VLAN 100"),
    ):
        create = network_pb2.CreateFlowRuleRequest(flow_rule_id="r1", flow_rule=refused)
        with pytest.raises(
            PermissionDenied, match=rf"^actions\[0\]: forward to uplink p0: .*{what}"
        ):
            call(A, lambda: service.CreateFlowRule(create, CONTEXT))  # noqa: B023 - run at once
    bulk = network_pb2.ApplyFlowRulesRequest(
        creates=[push_rule("flowRules/ok", 250, 1001), forward_rule("flowRules/r2", 1002)]
    )
    with pytest.raises(PermissionDenied, match="forward to uplink p0"):
        call(A, lambda: service.ApplyFlowRules(bulk, CONTEXT))
    assert table.rules() == []
    made = network_pb2.CreateFlowRuleRequest(flow_rule_id="r1", flow_rule=push_rule("", 250))
    call(A, lambda: service.CreateFlowRule(made, CONTEXT))  # pushed into its own VLAN: fine
    update = network_pb2.UpdateFlowRuleRequest(flow_rule=forward_rule("flowRules/r1"))
    with pytest.raises(PermissionDenied, match="forward to uplink p0"):
        call(A, lambda: service.UpdateFlowRule(update, CONTEXT))
    bulk_update = network_pb2.ApplyFlowRulesRequest(updates=[forward_rule("flowRules/r1")])
    with pytest.raises(PermissionDenied, match="forward to uplink p0"):
        call(A, lambda: service.ApplyFlowRules(bulk_update, CONTEXT))
    assert table.get("r1").actions == (model.VlanPush(250), model.Forward("p0"))  # unchanged
    kept = network_pb2.UpdateFlowRuleRequest(flow_rule=forward_rule("flowRules/r1", 1010, 250))
    call(A, lambda: service.UpdateFlowRule(kept, CONTEXT))  # its own VLAN 250, matched and kept
    own = network_pb2.CreateFlowRuleRequest(flow_rule_id="r9", flow_rule=forward_rule("", 5))
    call(ADMIN, lambda: service.CreateFlowRule(own, CONTEXT))  # the admin: anything
    trusting = tags.parse({"tenant": {"tenant-a": {"untagged": True}}}, "test")
    service = NetworkService(table, owners=functions, tags=trusting)
    plain = network_pb2.CreateFlowRuleRequest(flow_rule_id="r2", flow_rule=forward_rule("", 1002))
    assert call(A, lambda: service.CreateFlowRule(plain, CONTEXT)).name == "flowRules/r2"

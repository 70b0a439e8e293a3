"""Flow rules and tenants: the owner is kept in the rule store (older files load as the
default tenant's), and a function's representor port belongs to the function's tenant."""

import json

import pytest

from dpu_agent.auth import Principal
from dpu_agent.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from dpu_agent.network import model, tags
from dpu_agent.network.access import check_rule_access, check_rule_ports
from dpu_agent.network.memory_backend import MemoryFlowBackend
from dpu_agent.network.rulestore import RuleStore
from dpu_agent.network.table import FlowTable
from dpu_agent.virtualization.manager import FunctionManager
from dpu_agent.virtualization.memory_backend import MemoryFunctionBackend
from dpu_agent.virtualization.model import FunctionSpec, FunctionType
from dpu_agent.virtualization.store import FunctionStore


def rule(rule_id, priority, tenant, port="pf0vf0"):
    return model.FlowRule(
        rule_id, priority, port, model.FlowMatch(), (model.Drop(),), tenant=tenant
    )


def test_the_owner_is_saved_and_loaded(tmp_path):
    store = RuleStore(tmp_path / "rules.json")
    table = FlowTable(MemoryFlowBackend(), store)
    table.start()
    table.create(rule("a-rule", 10, "tenant-a"))
    again = FlowTable(MemoryFlowBackend(), store)
    again.start()
    assert again.get("a-rule").tenant == "tenant-a"


def test_a_file_without_tenants_loads_as_the_default_tenants(tmp_path):
    path = tmp_path / "rules.json"
    RuleStore(path).save([rule("old", 10, "tenant-a")])
    data = json.loads(path.read_text())
    for item in data["rules"]:
        del item["tenant"]
    path.write_text(json.dumps(data))
    assert [r.tenant for r in RuleStore(path).load()] == ["default"]


def test_a_priority_clash_names_only_the_callers_own_rule(tmp_path):
    table = FlowTable(MemoryFlowBackend(), RuleStore(tmp_path / "rules.json"))
    table.start()
    table.create(rule("a-rule", 10, "tenant-a"))
    with pytest.raises(AlreadyExists, match="priority 10") as theirs:
        table.create(rule("b-rule", 10, "tenant-b"))
    assert "a-rule" not in str(theirs.value)
    with pytest.raises(AlreadyExists, match="flowRules/a-rule"):
        table.create(rule("a-two", 10, "tenant-a"))


# ------------------------------------------------------------------ who may name a port

A = Principal("tenant-a")
B = Principal("tenant-b")
ADMIN = Principal("ops", admin=True)
MANAGED = {"p0", "pf0vf0", "pf0vf1", "pf0vf2", "eth5"}
OWNERS = {"pf0vf0": "tenant-a", "pf0vf1": "tenant-b"}  # pf0vf2: no function yet


def named(ingress, *targets, mirror=False):
    kind = model.Mirror if mirror else model.Forward
    return model.FlowRule("r", 10, ingress, model.FlowMatch(), tuple(kind(t) for t in targets))


@pytest.mark.parametrize(
    ("principal", "rule", "owners", "refused"),
    [
        (A, named("pf0vf0", "p0"), OWNERS, None),  # its own representor
        (A, named("pf0vf0", "pf0vf1"), OWNERS, "ports/pf0vf1"),  # B's, as a target
        (A, named("pf0vf0", "pf0vf1", mirror=True), OWNERS, "ports/pf0vf1"),
        (B, named("pf0vf0", "pf0vf1", mirror=True), OWNERS, "ports/pf0vf0"),  # A's ingress
        (B, named("pf0vf2", "pf0vf1"), OWNERS, "ports/pf0vf2"),  # nobody's yet
        (B, named("pf0vf1", "pf0vf2"), OWNERS, "ports/pf0vf2"),
        (B, named("pf0vf1", "eth5"), OWNERS, None),  # a host netdev: shared
        (B, named("eth5", "pf0vf1"), OWNERS, None),
        (B, named("p0", "pf0vf1"), OWNERS, PermissionDenied),  # uplink ingress: admin only
        (B, named("nope", "pf0vf1"), OWNERS, "ports/nope"),  # missing: the same answer
        (B, named("pf0vf1", "nope"), OWNERS, "ports/nope"),
        (ADMIN, named("pf0vf0", "pf0vf1"), OWNERS, None),  # the admin: any managed port
        (ADMIN, named("p0", "pf0vf2"), OWNERS, None),
        (ADMIN, named("nope", "pf0vf2"), OWNERS, "ports/nope"),
        (B, named("pf0vf0", "pf0vf2"), None, None),  # no function backend: today's rules
        (B, named("p0", "pf0vf2"), None, PermissionDenied),
    ],
)
def test_who_may_name_which_port(principal, rule, owners, refused):
    if refused is None:
        check_rule_ports(rule, principal, MANAGED, owners)
    elif refused is PermissionDenied:
        with pytest.raises(PermissionDenied, match="needs the admin role"):
            check_rule_ports(rule, principal, MANAGED, owners)
    else:
        with pytest.raises(NotFound) as info:
            check_rule_ports(rule, principal, MANAGED, owners)
        assert str(info.value) == f"{refused} does not exist"


# ------------------------------------------------------------------ whose priorities


def at(priority, principal=A, port="pf0vf0"):
    return model.FlowRule(
        "r", priority, port, model.FlowMatch(), (model.Drop(),), tenant=principal.tenant
    )


@pytest.mark.parametrize(
    ("principal", "priority", "refused"),
    [
        (A, 1, PermissionDenied),  # before the admin's rules on its port: refused
        (A, 999, PermissionDenied),
        (A, 1000, None),  # the tenants' band
        (A, 65535, None),
        (ADMIN, 1, None),  # the admin's band
        (ADMIN, 999, None),
        (ADMIN, 1000, None),
        (A, 0, InvalidArgument),  # not a priority, for anyone
        (ADMIN, 0, InvalidArgument),
        (A, 65536, InvalidArgument),
    ],
)
def test_priorities_below_the_band_are_the_admins(principal, priority, refused):
    """A tenant's rule with a lower number than an admin's on its port ran first: its
    forward or drop bypassed the admin's rate limit, drop or VLAN push there."""
    rule = at(priority, principal)
    if refused is None:
        check_rule_access(rule, principal, MANAGED, OWNERS, tags.TenantTags())
    elif refused is PermissionDenied:
        with pytest.raises(PermissionDenied) as denied:
            check_rule_access(rule, principal, MANAGED, OWNERS, tags.TenantTags())
        assert str(denied.value) == (
            f"priority {priority}: 1..999 are the admin role's (its rules there come before"
            " any tenant's on the port); use 1000..65535"
        )
    else:
        with pytest.raises(InvalidArgument, match=r"priority must be 1\.\.65535"):
            check_rule_access(rule, principal, MANAGED, OWNERS, tags.TenantTags())


def test_the_port_is_checked_before_the_priority():
    """Another tenant's port answers NOT_FOUND as a missing one, whatever the priority."""
    with pytest.raises(NotFound, match=r"^ports/pf0vf1 does not exist$"):
        check_rule_access(at(5, A, "pf0vf1"), A, MANAGED, OWNERS, tags.TenantTags())


def test_a_delete_refusal_names_only_the_functions_own_tenants_rules(tmp_path):
    rules = [
        rule("theirs-1", 1, "tenant-b"),
        rule("theirs-2", 2, "ops"),
        model.FlowRule(
            "mine", 3, "pf0vf1", model.FlowMatch(), (model.Mirror("pf0vf0"),), tenant="tenant-a"
        ),
    ]
    manager = FunctionManager(
        MemoryFunctionBackend(), FunctionStore(tmp_path / "f.json"), flow_rules=lambda: rules
    )
    manager.start()
    made = manager.create(FunctionSpec("a-fn", FunctionType.VF, tenant="tenant-a"))
    assert made.provisioned is not None
    assert made.provisioned.representor_port == "pf0vf0"
    with manager.port_owners() as owners:
        assert owners == {"pf0vf0": "tenant-a"}
    with pytest.raises(FailedPrecondition) as refused:
        manager.delete("a-fn")
    message = str(refused.value)
    assert "flow rule(s) mine" in message
    assert "2 flow rule(s) of another tenant" in message
    assert "theirs" not in message
    rules[:] = rules[:2]
    with pytest.raises(FailedPrecondition) as refused:
        manager.delete("a-fn")
    assert "theirs" not in str(refused.value)
    rules.clear()
    manager.delete("a-fn")

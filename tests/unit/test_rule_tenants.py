"""Flow rules keep their owning tenant in the rule store; older files load as the default's."""

import json

import pytest

from dpu_agent.errors import AlreadyExists
from dpu_agent.network import model
from dpu_agent.network.memory_backend import MemoryFlowBackend
from dpu_agent.network.rulestore import RuleStore
from dpu_agent.network.table import FlowTable


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

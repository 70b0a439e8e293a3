"""Flow-rule validation, persistence and the flow table over the in-memory datapath."""

import ipaddress

import pytest

from dpu_agent.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from dpu_agent.network import model
from dpu_agent.network.memory_backend import MemoryFlowBackend
from dpu_agent.network.rulestore import RuleStore, from_json, to_json
from dpu_agent.network.table import Changes, FlowTable
from dpu_agent.network.validate import check_rule

PORTS = {"p0", "pf0vf0", "pf0vf1"}
net = ipaddress.ip_network
M = model.FlowMatch


ANY = M()
TO_VF1 = (model.Forward("pf0vf1"),)


def rule(match=ANY, actions=TO_VF1, priority=10, port="pf0vf0", rid="r1"):
    return model.FlowRule(rid, priority, port, match, tuple(actions))


@pytest.mark.parametrize(
    ("candidate", "reason"),
    [
        (rule(priority=0), "priority must be 1..65535"),
        (rule(port="eth9"), "ingress port 'eth9' is not a managed port"),
        (rule(match=M(dst_port=80)), "L4 port needs ip_protocol"),
        (rule(match=M(dst_port=80, ip_protocol=1, ethertype=0x0800)), "L4 port needs ip_protocol"),
        (rule(match=M(ip_protocol=17)), "ip_protocol needs an IP ethertype"),
        (
            rule(match=M(ethertype=0x0806, dst_ip=net("10.0.0.0/8"))),
            "0x0806 does not carry the IP version",
        ),
        (
            rule(match=M(ethertype=0x86DD, dst_ip=net("10.0.0.0/8"))),
            "does not carry the IP version",
        ),
        (rule(match=M(src_ip=net("10.0.0.0/8"), dst_ip=net("::/0"))), "different IP versions"),
        (rule(match=M(vlan_id=5000)), "vlan_id must be 0..4094"),
        (rule(match=M(src_mac="zz:00:00:00:00:00")), "is not a MAC address"),
        (rule(actions=()), "at least one action"),
        (rule(actions=(model.Forward("pf0vf0"),)), "its own ingress port"),
        (rule(actions=(model.Forward("nope"),)), "'nope' is not a managed port"),
        (rule(actions=(model.Forward("p0"), model.Forward("pf0vf1"))), "at most one port"),
        (rule(actions=(model.Forward("p0"), model.Drop())), "both forward and drop"),
        (rule(actions=(model.Drop(), model.Count())), "drop must be the last action"),
        (rule(actions=(model.Police(0, 1000),)), "police.rate_bps must be 8.."),
        (rule(actions=(model.VlanPush(0),)), "vlan_push.vlan_id must be 1..4094"),
        (
            rule(
                actions=(
                    model.VxlanEncap(
                        5, ipaddress.ip_address("10.0.0.1"), ipaddress.ip_address("10.0.0.2")
                    ),
                )
            ),
            "must be followed by a forward",
        ),
    ],
)
def test_contradictions_are_refused_with_a_reason(candidate, reason):
    with pytest.raises(InvalidArgument, match=reason):
        check_rule(candidate, PORTS)


def test_a_full_rule_is_valid_and_round_trips_through_json():
    full = rule(
        match=M(
            ethertype=0x0800,
            src_mac="02:00:00:00:00:01",
            vlan_id=10,
            ip_protocol=17,
            src_ip=net("10.0.0.0/24"),
            dst_ip=net("10.0.1.0/24"),
            src_port=1000,
            dst_port=2000,
            vxlan_vni=42,
        ),
        actions=(
            model.Police(8_000_000, 10_000),
            model.VlanPush(100, 3),
            model.Mirror("p0"),
            model.Count(),
            model.Forward("pf0vf1"),
        ),
    )
    check_rule(full, PORTS)
    assert from_json(to_json(full)) == full


def test_table_saves_rules_and_a_new_table_reapplies_them(tmp_path):
    store = RuleStore(tmp_path / "rules.json")
    backend = MemoryFlowBackend(sorted(PORTS))
    table = FlowTable(backend, store)
    table.start()
    table.create(rule())
    table.create(rule(rid="r2", priority=20, actions=(model.Drop(),)))
    with pytest.raises(AlreadyExists, match="already has priority 10"):
        table.create(rule(rid="r3"))
    with pytest.raises(AlreadyExists):
        table.create(rule())
    fresh_backend = MemoryFlowBackend(sorted(PORTS))  # an empty datapath, as after a reboot
    again = FlowTable(fresh_backend, RuleStore(tmp_path / "rules.json"))
    report = again.start()
    assert sorted(report.reapplied) == ["r1", "r2"]
    assert [i.rule_id for i in fresh_backend.installed()] == ["r1", "r2"]


def test_update_keeps_the_old_rule_when_the_new_one_fails(tmp_path):
    table = FlowTable(MemoryFlowBackend(sorted(PORTS)), RuleStore(tmp_path / "rules.json"))
    table.start()
    table.create(rule())
    with pytest.raises(InvalidArgument):
        table.update(rule(actions=(model.Forward("pf0vf0"),)))
    assert table.get("r1").actions == (model.Forward("pf0vf1"),)
    table.update(rule(priority=5))
    assert table.get("r1").priority == 5
    table.delete("r1")
    with pytest.raises(NotFound):
        table.get("r1")
    assert RuleStore(tmp_path / "rules.json").load() == []


def test_foreign_filters_are_reported(tmp_path):
    backend = MemoryFlowBackend(sorted(PORTS))
    backend.install(rule(rid="made-by-hand", priority=99))
    table = FlowTable(backend, RuleStore(tmp_path / "rules.json"))
    report = table.start()
    assert [(f.ingress_port, f.priority) for f in report.foreign] == [("pf0vf0", 99)]


class FailingBackend(MemoryFlowBackend):
    """Refuses to install the rule with id `refuse` (a datapath failing half-way)."""

    refuse = "r-25"

    def install(self, rule):
        if rule.rule_id == self.refuse:
            raise FailedPrecondition("the kernel refused it")
        super().install(rule)


def test_a_bulk_change_failing_half_way_leaves_datapath_table_and_store_as_before(tmp_path):
    backend = FailingBackend(sorted(PORTS))
    store = RuleStore(tmp_path / "rules.json")
    table = FlowTable(backend, store)
    table.start()
    table.create(rule(rid="old", priority=1))
    table.create(rule(rid="gone", priority=2))
    before = (set(backend.installed()), table.rules(), store.load())
    creates = tuple(rule(rid=f"r-{n}", priority=100 + n) for n in range(50))
    changes = Changes(creates, (rule(rid="old", priority=2),), ("gone",))
    with pytest.raises(FailedPrecondition):
        table.apply(changes)
    assert (set(backend.installed()), table.rules(), store.load()) == before
    backend.refuse = ""
    applied = table.apply(changes)
    assert [r.rule_id for r in applied.deleted] == ["gone"]
    assert sorted(r.rule_id for r in table.rules()) == sorted(
        ["old", *(r.rule_id for r in creates)]
    )
    assert table.get("old").priority == 2
    assert len(store.load()) == 51
    assert {i.rule_id for i in backend.installed()} == {r.rule_id for r in table.rules()}


def test_a_bulk_change_that_cannot_be_saved_is_undone_in_the_datapath(tmp_path):
    class BrokenStore(RuleStore):
        def save(self, rules):  # noqa: ARG002 - refuses any
            raise OSError("disk full")

    backend = MemoryFlowBackend(sorted(PORTS))
    table = FlowTable(backend, BrokenStore(tmp_path / "rules.json"))
    table.start()
    with pytest.raises(OSError, match="disk full"):
        table.apply(Changes((rule(rid="a"), rule(rid="b", priority=11))))
    assert backend.installed() == []
    assert table.rules() == []


def _disk_full(path):
    """The next save of `path` writes to /dev/full: the kernel answers ENOSPC."""
    path.with_name(path.name + ".tmp").symlink_to("/dev/full")


def test_changes_that_cannot_be_saved_for_a_full_disk_are_undone_everywhere(tmp_path):
    """A full disk (the volumes share it) made a rule's update and delete fail with
    INTERNAL after the datapath and the table had changed: the saved file disagreed
    with both, and the next start brought back what the table had dropped. Now each
    change answers RESOURCE_EXHAUSTED and leaves datapath, table and file as before."""
    path = tmp_path / "rules.json"
    backend = MemoryFlowBackend(sorted(PORTS))
    table = FlowTable(backend, RuleStore(path))
    table.start()
    table.create(rule())
    saved = path.read_text()
    before = (backend.installed(), table.rules())
    _disk_full(path)
    for change in (
        lambda: table.create(rule(rid="r2", priority=20)),
        lambda: table.update(rule(priority=5)),
        lambda: table.delete("r1"),
        lambda: table.apply(Changes((rule(rid="r3", priority=30),), (), ("r1",))),
    ):
        with pytest.raises(ResourceExhausted, match="no space left to save the flow rules"):
            change()
        assert (backend.installed(), table.rules()) == before
        assert path.read_text() == saved
        assert path.with_name("rules.json.tmp").exists() is False  # no half file left
        _disk_full(path)


def test_a_bulk_change_checks_ids_and_priorities_of_the_result(tmp_path):
    table = FlowTable(MemoryFlowBackend(sorted(PORTS)), RuleStore(tmp_path / "rules.json"))
    table.start()
    table.create(rule(rid="a", priority=1))
    with pytest.raises(AlreadyExists, match="already has priority 1"):
        table.apply(Changes((rule(rid="b", priority=1),)))
    with pytest.raises(AlreadyExists, match="already has priority 5"):
        table.apply(Changes((rule(rid="b", priority=5), rule(rid="c", priority=5))))
    with pytest.raises(AlreadyExists, match="flowRules/a already exists"):
        table.apply(Changes((rule(rid="a", priority=9),)))
    with pytest.raises(NotFound):
        table.apply(Changes(delete=("zz",)))
    with pytest.raises(InvalidArgument, match="more than once"):
        table.apply(Changes((rule(rid="b", priority=7), rule(rid="b", priority=8))))
    with pytest.raises(InvalidArgument, match="more than once"):
        table.apply(Changes(update=(rule(rid="a", priority=7),), delete=("a",)))
    table.apply(Changes((rule(rid="b", priority=1),), delete=("a",)))  # freed in the same unit
    assert [r.rule_id for r in table.rules()] == ["b"]
    moved = rule(rid="b", priority=1, port="pf0vf1", actions=(model.Forward("pf0vf0"),))
    table.apply(Changes((moved,), delete=("b",)))  # deleted and created: moved to a port
    assert table.rules() == [moved]


def test_start_reapplies_in_one_batch_and_reports_the_rule_that_fails(tmp_path):
    store = RuleStore(tmp_path / "rules.json")
    store.save([rule(rid=f"r-{n}", priority=n + 1) for n in range(30)])
    backend = FailingBackend(sorted(PORTS))
    report = FlowTable(backend, store).start()
    assert [rule_id for rule_id, _ in report.failed] == ["r-25"]
    assert len(report.reapplied) == 29
    assert len(backend.installed()) == 29
    fresh = MemoryFlowBackend(sorted(PORTS))
    assert len(FlowTable(fresh, store).start().reapplied) == 30


def test_a_change_encodes_only_the_rules_it_changed(tmp_path, monkeypatch):
    """Every change rewrites the rule file; encoding every rule again each time made a
    change of any tenant cost the agent ~2 s of CPU under the table's lock with 16
    tenants at their quota of 1024 rules. The rules that did not change keep their text."""
    from dpu_agent.network import rulestore  # noqa: PLC0415 - its to_json is counted

    store = RuleStore(tmp_path / "rules.json")
    table = FlowTable(MemoryFlowBackend(sorted(PORTS)), store)
    table.start()
    table.apply(Changes(tuple(rule(priority=1000 + i, rid=f"r{i}") for i in range(100)), (), ()))
    encoded = []

    def counted(r):
        encoded.append(r)
        return to_json(r)

    monkeypatch.setattr(rulestore, "to_json", counted)
    changed = rule(priority=2000, rid="r7", actions=(model.Drop(),))
    table.update(changed)
    assert encoded == [changed]
    table.delete("r8")
    table.create(rule(priority=3000, rid="new"))
    assert [r.rule_id for r in encoded] == ["r7", "new"]
    loaded = {r.rule_id: r for r in RuleStore(tmp_path / "rules.json").load()}
    assert loaded["r7"] == changed
    assert sorted(loaded) == sorted([*(f"r{i}" for i in range(100) if i != 8), "new"])
    assert loaded["r3"] == rule(priority=1003, rid="r3")

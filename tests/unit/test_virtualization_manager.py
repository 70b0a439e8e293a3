"""FunctionManager over the memory backend: checks, transactions, recovery."""

import dataclasses
import json

import pytest

from dpu_agent.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from dpu_agent.network.model import FlowMatch, FlowRule, Forward, Mirror
from dpu_agent.storage import DataServices, MemoryVolumeStore
from dpu_agent.storage.exports import GuardedVolumeStore, VolumeExports
from dpu_agent.virtualization.manager import FunctionManager, rules_on_port
from dpu_agent.virtualization.memory_backend import MemoryFunctionBackend
from dpu_agent.virtualization.model import (
    FunctionRecord,
    FunctionSpec,
    FunctionState,
    FunctionType,
    Provisioned,
    normalize_mac,
)
from dpu_agent.virtualization.store import FunctionStore


@pytest.fixture
def parts(tmp_path):
    volumes = MemoryVolumeStore()
    exports = VolumeExports()
    rules: list[FlowRule] = []
    backend = MemoryFunctionBackend()
    manager = FunctionManager(
        backend,
        FunctionStore(tmp_path / "functions.json"),
        volumes=volumes,
        exports=exports,
        flow_rules=lambda: list(rules),
    )
    manager.start()
    return manager, backend, volumes, exports, rules


def vf(name, **kw):
    return FunctionSpec(function_id=name, type=FunctionType.VF, **kw)


def test_spec_checks_name_the_field():
    with pytest.raises(InvalidArgument, match="mtu"):
        vf("a", mtu=10_000)
    with pytest.raises(InvalidArgument, match="vlan_id"):
        vf("a", vlan_id=0)
    with pytest.raises(InvalidArgument, match="needs a volume"):
        FunctionSpec(function_id="b", type=FunctionType.VIRTIO_BLK)
    with pytest.raises(InvalidArgument, match="no network settings"):
        FunctionSpec(function_id="b", type=FunctionType.NVME, volume_id="v", vlan_id=3)
    assert normalize_mac("02-AB-00-00-00-01") == "02:ab:00:00:00:01"
    with pytest.raises(InvalidArgument, match="multicast"):
        normalize_mac("03:00:00:00:00:01")


def test_create_get_list_update_delete(parts):
    manager, backend, *_ = parts
    a = manager.create(vf("a", mtu=9000))
    b = manager.create(vf("b"))
    assert a.provisioned.representor_port == "pf0vf0"
    assert b.provisioned.representor_port == "pf0vf1"
    assert a.state is FunctionState.READY
    assert [r.spec.function_id for r in manager.list()] == ["a", "b"]
    with pytest.raises(AlreadyExists):
        manager.create(vf("a"))
    changed = manager.update("a", {"vlan_id": 12, "rate_limit_bps": 10**6})
    assert changed.spec.vlan_id == 12
    assert backend.functions["a"].vlan_id == 12
    with pytest.raises(FailedPrecondition, match="cannot change type"):
        manager.update("a", {"type": FunctionType.SF})
    manager.delete("a")
    with pytest.raises(NotFound):
        manager.get("a")
    c = manager.create(vf("c"))
    assert c.provisioned.representor_port == "pf0vf0"  # freed names are reused
    assert manager.by_port("pf0vf1").spec.function_id == "b"


def test_a_failed_create_leaves_nothing(parts, tmp_path):
    manager, backend, volumes, exports, _ = parts
    volumes.create("v", 1 << 20, 4096, DataServices())
    backend.fail_create = "injected"
    with pytest.raises(FailedPrecondition, match="injected"):
        manager.create(FunctionSpec(function_id="d", type=FunctionType.NVME, volume_id="v"))
    assert manager.list() == []
    assert exports.holder("v") is None
    saved = json.loads((tmp_path / "functions.json").read_text())
    assert saved["functions"] == []


def test_delete_is_refused_while_a_rule_or_a_mount_uses_the_function(parts):
    manager, backend, _, _, rules = parts
    manager.create(vf("a"))
    manager.create(vf("b"))
    rules.append(FlowRule("r1", 1, "pf0vf0", FlowMatch(), (Forward("pf0vf1"),)))
    for name in ("a", "b"):  # ingress port, and the port an action sends to
        with pytest.raises(FailedPrecondition, match="r1"):
            manager.delete(name)
    rules.clear()
    backend.busy_reason["a"] = "/dev/x is mounted on /mnt"
    with pytest.raises(FailedPrecondition, match="mounted"):
        manager.delete("a")
    assert manager.get("a").state is FunctionState.READY
    del backend.busy_reason["a"]
    manager.delete("a")


def test_rules_on_port_sees_ingress_forward_and_mirror():
    rules = [
        FlowRule("in", 1, "p0", FlowMatch(), (Forward("p1"),)),
        FlowRule("mirror", 2, "p1", FlowMatch(), (Mirror("p0"),)),
        FlowRule("other", 3, "p1", FlowMatch(), (Forward("p2"),)),
    ]
    assert [r.rule_id for r in rules_on_port(rules, "p0")] == ["in", "mirror"]


def test_an_exported_volume_is_off_limits_to_everyone_else(parts):
    manager, _, volumes, exports, _ = parts
    volumes.create("v", 1 << 20, 4096, DataServices())
    guarded = GuardedVolumeStore(volumes, exports)
    guarded.write("v", 0, b"\1" * 4096)
    manager.create(FunctionSpec(function_id="disk", type=FunctionType.NVME, volume_id="v"))
    for call in (
        lambda: guarded.write("v", 0, b"\2" * 4096),
        lambda: guarded.read("v", 0, 4096),
        lambda: guarded.trim("v", 0, 4096),
        lambda: guarded.flush("v"),
        lambda: guarded.resize("v", 2 << 20),
        lambda: guarded.delete("v"),
    ):
        with pytest.raises(FailedPrecondition, match="functions/disk"):
            call()
    assert guarded.get("v").size_bytes == 1 << 20  # reads of metadata are fine
    with pytest.raises(FailedPrecondition, match="already exported"):
        manager.create(FunctionSpec(function_id="disk2", type=FunctionType.NVME, volume_id="v"))
    manager.delete("disk")
    assert guarded.read("v", 0, 4096) == b"\1" * 4096


def test_recovery_cleans_interrupted_creates_and_restores_the_rest(tmp_path):
    path = tmp_path / "functions.json"
    store = FunctionStore(path)
    ready = FunctionRecord(vf("ok"), Provisioned("pf0vf0", "eth"), FunctionState.READY, 1, 1)
    half = FunctionRecord(vf("half"), None, FunctionState.CREATING, 2, 2)
    dying = FunctionRecord(vf("dying"), Provisioned("pf0vf1", "eth"), FunctionState.DELETING, 3, 3)
    store.save([ready, half, dying])
    backend = MemoryFunctionBackend()
    deleted = []
    original = backend.delete

    def spy(spec, made):
        deleted.append((spec.function_id, made))
        original(spec, made)

    backend.delete = spy  # type: ignore[method-assign]
    manager = FunctionManager(backend, store)
    report = manager.start()
    assert sorted(report.cleaned) == ["dying", "half"]
    assert ("half", Provisioned("", "")) in deleted  # found by its id alone
    assert report.restored == ("ok",)  # the memory backend forgot it: made again
    assert [r.spec.function_id for r in manager.list()] == ["ok"]
    assert [r["spec"]["function_id"] for r in json.loads(path.read_text())["functions"]] == ["ok"]


def test_store_round_trips_every_field(tmp_path):
    spec = FunctionSpec(
        function_id="x",
        type=FunctionType.VIRTIO_NET,
        tenant="t1",
        mac="02:00:00:00:00:09",
        mtu=1400,
        vlan_id=5,
        rate_limit_bps=10**6,
        trust=True,
        spoof_check=False,
    )
    record = FunctionRecord(spec, Provisioned("pf0vf3", "fn-x/eth0", {"netns": "fn-x"}),
                            FunctionState.READY, 5, 6)  # fmt: skip
    store = FunctionStore(tmp_path / "f.json")
    store.save([record])
    assert store.load() == [record]
    assert dataclasses.asdict(store.load()[0].spec) == dataclasses.asdict(spec)

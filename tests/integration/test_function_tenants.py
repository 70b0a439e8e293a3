"""Functions are tenant-owned: another tenant cannot see, change, delete or borrow them,
and a tenant's flow rules use only the VLAN ids and VNIs granted to it."""

import grpc
import pytest
from google.protobuf import field_mask_pb2

import host_client
from dpu_wire.v1 import network_pb2, virtualization_pb2
from tests.integration.conftest import start_agent
from tests.integration.pki import make_pki

pytestmark = pytest.mark.asyncio
VF = virtualization_pb2.FUNCTION_TYPE_VF
NVME = virtualization_pb2.FUNCTION_TYPE_NVME


# the operator's grants: A's segments are VLANs 200-299 and VNI 7000, B's VLAN 100, VNI 5000;
# C has the uplinks to itself (no tag, untagged traffic allowed)
TENANT_TAGS = """
[tenant.tenant-a]
vlans = ["200-299"]
vnis = [7000]

[tenant.tenant-b]
vlans = [100]
vnis = ["5000"]

[tenant.tenant-c]
untagged = true
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    directory = tmp_path_factory.mktemp("agent")
    tags = directory / "tenant-tags.toml"
    tags.write_text(TENANT_TAGS)
    tags.chmod(0o644)
    agent = start_agent(
        directory,
        pki=pki,
        env={
            "DPU_AGENT_NETWORK_BACKEND": "memory",
            "DPU_AGENT_VIRT_BACKEND": "memory",
            "DPU_AGENT_STORAGE_BACKEND": "memory",
            "DPU_AGENT_NETWORK_TENANT_TAGS_FILE": str(tags),
        },
    )
    yield agent, pki
    assert agent.terminate() == 0, agent.log_path.read_text()


def client(setup, name, *, admin=False):
    agent, pki = setup
    return host_client.Client(agent.address, tls=pki.client(name, admin=admin))


async def test_a_tenant_sees_and_touches_only_its_own_functions(setup):
    async with (
        client(setup, "tenant-a") as a,
        client(setup, "tenant-b") as b,
        client(setup, "ops", admin=True) as admin,
    ):
        made = await a.create_function("a-fn", virtualization_pb2.Function(type=VF))
        assert made.tenant == "tenant-a"
        await b.create_function("b-fn", virtualization_pb2.Function(type=VF))
        with pytest.raises(host_client.NotFoundError) as missing:
            await b.get_function("functions/nothing")
        calls = (
            lambda: b.get_function("functions/a-fn"),
            lambda: b.delete_function("functions/a-fn"),
            lambda: b.update_function(
                virtualization_pb2.Function(name="functions/a-fn", mtu=1400), ["mtu"]
            ),
        )
        for call in calls:
            with pytest.raises(host_client.NotFoundError) as theirs:
                await call()
            assert theirs.value.message.replace("a-fn", "X") == missing.value.message.replace(
                "nothing", "X"
            )
        assert [f.name for f in await b.list_functions()] == ["functions/b-fn"]
        assert (await a.get_function("functions/a-fn")).mtu == 1500  # untouched
        everything = {f.name: f.tenant for f in await admin.list_functions()}
        assert everything == {"functions/a-fn": "tenant-a", "functions/b-fn": "tenant-b"}
        # a block function cannot expose another tenant's volume
        await a.create_volume("a-vol", 1 << 20)
        with pytest.raises(host_client.NotFoundError, match="a-vol"):
            await b.create_function(
                "b-disk", virtualization_pb2.Function(type=NVME, volume="volumes/a-vol")
            )
        disk = await a.create_function(
            "a-disk", virtualization_pb2.Function(type=NVME, volume="volumes/a-vol")
        )
        assert disk.volume == "volumes/a-vol"
        await a.delete_function("functions/a-disk")
        await a.delete_function("functions/a-fn")
        await b.delete_function("functions/b-fn")


def rule(port, *actions, priority=1010):  # a tenant's rules: 1000 and up
    return network_pb2.FlowRule(
        priority=priority, ingress_port=f"ports/{port}", actions=list(actions)
    )


def forward(port):
    return network_pb2.FlowAction(forward=network_pb2.ForwardAction(port=f"ports/{port}"))


def mirror(port):
    return network_pb2.FlowAction(mirror=network_pb2.MirrorAction(port=f"ports/{port}"))


DROP = network_pb2.FlowAction(drop=network_pb2.DropAction())


async def test_only_a_functions_tenant_may_name_its_representor_in_a_flow_rule(setup):
    """The attack of issue 14: B's mirror and drop on A's pf0vf0 blocked A's delete."""
    async with (
        client(setup, "tenant-a") as a,
        client(setup, "tenant-b") as b,
        client(setup, "ops", admin=True) as admin,
    ):
        a_port = await a.create_function("a-vf", virtualization_pb2.Function(type=VF))
        b_port = await b.create_function("b-vf", virtualization_pb2.Function(type=VF))
        a_rep = a_port.representor_port.removeprefix("ports/")
        b_rep = b_port.representor_port.removeprefix("ports/")
        free = next(p for p in ("pf0vf0", "pf0vf1", "pf0vf2") if p not in (a_rep, b_rep))
        attempts = {
            "mirror A's traffic to B": (a_rep, rule(a_rep, mirror(b_rep))),
            "drop A's traffic first": (a_rep, rule(a_rep, DROP, priority=1)),
            "inject into A's function": (a_rep, rule(b_rep, forward(a_rep))),
            "copy B's traffic to A": (a_rep, rule(b_rep, mirror(a_rep), DROP)),
            "wait on a port no function has yet": (free, rule(free, mirror(b_rep))),
        }
        refusals = {}
        for index, (what, (port, attempt)) in enumerate(attempts.items()):
            with pytest.raises(host_client.NotFoundError) as theirs:
                await b.create_flow_rule(f"b-{index}", attempt)
            refusals[what] = theirs.value.message.replace(port, "X")
        with pytest.raises(host_client.NotFoundError) as missing:
            await b.create_flow_rule("b-probe", rule("pf9vf9", forward(b_rep)))
        for what, message in refusals.items():  # as for a port that does not exist
            assert message == missing.value.message.replace("pf9vf9", "X"), what
        b_own = await b.create_flow_rule("b-own", rule(b_rep, push(100), forward("p0")))  # its own
        update = network_pb2.UpdateFlowRuleRequest(
            flow_rule=network_pb2.FlowRule(name=b_own.name, actions=[mirror(a_rep)]),
            update_mask=field_mask_pb2.FieldMask(paths=["actions"]),
        )
        with pytest.raises(grpc.aio.AioRpcError) as changed:  # nor by changing its actions
            await b.stubs.network.UpdateFlowRule(update)
        assert changed.value.code() == grpc.StatusCode.NOT_FOUND
        assert changed.value.details() == f"ports/{a_rep} does not exist"
        with pytest.raises(host_client.PermissionDeniedError, match="admin role"):
            await b.create_flow_rule("b-uplink", rule("p0", forward(b_rep)))
        assert [r.name for r in await admin.list_flow_rules()] == ["flowRules/b-own"]

        # A's delete is refused only by rules on its port, and names only A's own
        await admin.create_flow_rule("ops-watch", rule(a_rep, mirror(b_rep), priority=5))
        await a.create_flow_rule("a-own", rule(a_rep, push(250), forward("p0"), priority=1007))
        with pytest.raises(host_client.FailedPreconditionError) as refused:
            await a.delete_function("functions/a-vf")
        assert "a-own" in refused.value.message
        assert "ops-watch" not in refused.value.message
        assert "1 flow rule(s) of another tenant" in refused.value.message
        await admin.delete_flow_rule("flowRules/ops-watch")
        await a.delete_flow_rule("flowRules/a-own")
        await a.delete_function("functions/a-vf")
        await b.delete_flow_rule("flowRules/b-own")
        await b.delete_function("functions/b-vf")


async def test_a_functions_isolation_is_the_admins_to_set(setup):
    """A tenant could give its VF trust, no spoof check, another tenant's VLAN and MAC
    and no rate limit (an outside audit). Those are the operator's now, and MAC
    addresses are unique among functions."""
    async with (
        client(setup, "tenant-a") as a,
        client(setup, "tenant-b") as b,
        client(setup, "ops", admin=True) as ops,
    ):
        chosen = [
            virtualization_pb2.Function(type=VF, vlan_id=100),
            virtualization_pb2.Function(type=VF, rate_limit_bps=10**7),
            virtualization_pb2.Function(type=VF, trust=True),
        ]
        for function in chosen:
            with pytest.raises(host_client.PermissionDeniedError, match="set by an admin"):
                await a.create_function("iso-a", function)
        mine = await a.create_function(
            "iso-a", virtualization_pb2.Function(type=VF, mac_address="02:00:00:00:0a:01")
        )
        assert mine.spoof_check  # a tenant's function sends only from its own MAC
        assert not mine.trust
        assert not mine.HasField("vlan_id")
        name = "functions/iso-a"
        for change, field in (
            (virtualization_pb2.Function(name=name, vlan_id=100), "vlan_id"),
            (virtualization_pb2.Function(name=name, spoof_check=False), "spoof_check"),
            (virtualization_pb2.Function(name=name, trust=True), "trust"),
        ):
            with pytest.raises(host_client.PermissionDeniedError, match="set by an admin"):
                await a.update_function(change, [field])
        with pytest.raises(host_client.FailedPreconditionError, match="another function's"):
            await b.create_function(
                "iso-b", virtualization_pb2.Function(type=VF, mac_address="02:00:00:00:0a:01")
            )
        # the operator sets them, on a tenant's function too
        changed = await ops.update_function(
            virtualization_pb2.Function(name="functions/iso-a", vlan_id=100), ["vlan_id"]
        )
        assert changed.vlan_id == 100
        await a.delete_function("functions/iso-a")


def push(vlan_id):
    return network_pb2.FlowAction(vlan_push=network_pb2.VlanPushAction(vlan_id=vlan_id))


def encap(vni):
    tunnel = network_pb2.VxlanEncapAction(vni=vni, src_ip="10.0.0.2", dst_ip="10.0.0.9")
    return network_pb2.FlowAction(vxlan_encap=tunnel)


async def test_a_tenant_pushes_only_the_tags_granted_to_it(setup):
    """A rule of tenant A pushed tenant B's VLAN (or encapsulated in B's VNI) and sent it
    out of the shared uplink: A's frames in B's segment (an outside audit, R07). The
    operator grants each tenant its tags ([network] tenant_tags_file); any other is
    PERMISSION_DENIED on create, update and bulk apply, and nothing changes."""
    async with (
        client(setup, "tenant-a") as a,
        client(setup, "tenant-b") as b,
        client(setup, "ops", admin=True) as ops,
    ):
        made = await a.create_function("tags-a", virtualization_pb2.Function(type=VF))
        port = made.representor_port.removeprefix("ports/")
        for rule_id, attempt, tag in (
            ("inj-vlan", rule(port, push(100), forward("p0")), "VLAN 100"),
            ("inj-vni", rule(port, encap(5000), forward("p0"), priority=1011), "VNI 5000"),
            ("inj-plain", rule(port, push(1), forward("p0"), priority=1012), "VLAN 1"),
        ):
            with pytest.raises(host_client.PermissionDeniedError) as denied:
                await a.create_flow_rule(rule_id, attempt)
            assert f"{tag} is not granted to tenant 'tenant-a'" in denied.value.message
        assert await ops.list_flow_rules() == []  # nothing was created
        own = await a.create_flow_rule("a-vlan", rule(port, push(250), forward("p0")))
        assert own.actions[0].vlan_push.vlan_id == 250  # its own segment: fine
        # its VNI (sent to the uplink in its VLAN: a VNI alone does not tag the frame)
        await a.create_flow_rule(
            "a-vni", rule(port, push(250), encap(7000), forward("p0"), priority=1011)
        )

        update = network_pb2.UpdateFlowRuleRequest(
            flow_rule=network_pb2.FlowRule(name=own.name, actions=[push(100), forward("p0")]),
            update_mask=field_mask_pb2.FieldMask(paths=["actions"]),
        )
        with pytest.raises(grpc.aio.AioRpcError) as changed:
            await a.stubs.network.UpdateFlowRule(update)
        assert changed.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "VLAN 100 is not granted" in (changed.value.details() or "")
        assert (await a.get_flow_rule(own.name)).actions[0].vlan_push.vlan_id == 250

        good = rule(port, push(299), forward("p0"), priority=1020)
        good.name = "flowRules/a-bulk"
        bad = rule(port, encap(5000), forward("p0"), priority=1021)
        bad.name = "flowRules/a-bulk-bad"
        with pytest.raises(host_client.PermissionDeniedError, match="VNI 5000 is not granted"):
            await a.apply_flow_rules(creates=[good, bad])
        assert sorted(r.name for r in await ops.list_flow_rules()) == [
            "flowRules/a-vlan",
            "flowRules/a-vni",
        ]
        # B holds VLAN 100; the operator uses any tag
        b_fn = await b.create_function("tags-b", virtualization_pb2.Function(type=VF))
        b_port = b_fn.representor_port.removeprefix("ports/")
        await b.create_flow_rule("b-vlan", rule(b_port, push(100), forward("p0")))
        await ops.create_flow_rule("ops-vlan", rule(port, push(4000), forward("p0"), priority=30))
        for name in ("flowRules/a-vlan", "flowRules/a-vni", "flowRules/ops-vlan"):
            await ops.delete_flow_rule(name)
        await b.delete_flow_rule("flowRules/b-vlan")
        await a.delete_function("functions/tags-a")
        await b.delete_function("functions/tags-b")


def police(rate_bps):
    limit = network_pb2.PoliceAction(rate_bps=rate_bps, burst_bytes=10_000)
    return network_pb2.FlowAction(police=limit)


async def test_a_tenants_rule_cannot_come_before_the_admins_on_its_port(setup):
    """tc runs a port's rules lowest priority first: A's forward at 5 on its own
    representor took its frames before the operator's rate limit at 10 there. Priorities
    below 1000 are the admin's: a tenant's is PERMISSION_DENIED and creates nothing."""
    async with client(setup, "tenant-a") as a, client(setup, "ops", admin=True) as ops:
        made = await a.create_function("band-a", virtualization_pb2.Function(type=VF))
        port = made.representor_port.removeprefix("ports/")
        await ops.create_flow_rule("ops-limit", rule(port, police(10**7), priority=10))
        for priority in (5, 999):
            with pytest.raises(host_client.PermissionDeniedError) as denied:
                await a.create_flow_rule(
                    "a-first", rule(port, push(250), forward("p0"), priority=priority)
                )
            assert denied.value.message.startswith(
                f"priority {priority}: 1..999 are the admin role's"
            )
        ahead = rule(port, push(250), forward("p0"), priority=5)
        ahead.name = "flowRules/a-first"
        with pytest.raises(host_client.PermissionDeniedError, match="priority 5: "):
            await a.apply_flow_rules(creates=[ahead])
        assert [r.name for r in await ops.list_flow_rules()] == ["flowRules/ops-limit"]
        after = await a.create_flow_rule(
            "a-after", rule(port, push(250), forward("p0"), priority=1000)
        )
        assert after.priority == 1000
        await ops.create_flow_rule("ops-drop", rule(port, DROP, priority=999))  # the admin's
        for name in ("flowRules/a-after", "flowRules/ops-limit", "flowRules/ops-drop"):
            await ops.delete_flow_rule(name)
        await a.delete_function("functions/band-a")


async def test_a_tenants_frames_reach_the_uplink_only_in_its_own_segment(setup):
    """A's rule forwarded its untagged frames to p0 (the uplink's native segment, every
    tenant's), or frames its guest tagged 100 itself (B's VLAN). A rule that sends to an
    uplink must push a granted VLAN id or match one and keep it, unless the operator
    gave the tenant untagged = true; else PERMISSION_DENIED, and nothing is created."""
    async with (
        client(setup, "tenant-a") as a,
        client(setup, "tenant-c") as c,
        client(setup, "ops", admin=True) as ops,
    ):
        made = await a.create_function("up-a", virtualization_pb2.Function(type=VF))
        port = made.representor_port.removeprefix("ports/")
        guest_tagged = rule(port, forward("p0"), priority=1011)
        guest_tagged.match.vlan_id = 100
        for rule_id, attempt, refusal in (
            ("untagged", rule(port, forward("p0")), "the frame is in no VLAN granted"),
            ("copy", rule(port, mirror("p0")), "the frame is in no VLAN granted"),
            ("b-segment", guest_tagged, "the frame is in VLAN 100 (match.vlan_id)"),
            ("vni", rule(port, encap(7000), forward("p0")), "a VNI does not tag"),
            ("late", rule(port, mirror("p0"), push(250), forward("p0")), "in no VLAN"),
        ):
            with pytest.raises(host_client.PermissionDeniedError) as denied:
                await a.create_flow_rule(rule_id, attempt)
            assert "uplink p0: " in denied.value.message
            assert refusal in denied.value.message
        assert await ops.list_flow_rules() == []  # nothing was created
        pushed = await a.create_flow_rule("a-pushed", rule(port, push(250), forward("p0")))
        assert [x.WhichOneof("action") for x in pushed.actions] == ["vlan_push", "forward"]
        own_tagged = rule(port, mirror("p0"), priority=1011)
        own_tagged.match.vlan_id = 250
        await a.create_flow_rule("a-kept", own_tagged)  # its own VLAN, matched and kept

        # C's grant: untagged uplink traffic
        c_fn = await c.create_function("up-c", virtualization_pb2.Function(type=VF))
        c_port = c_fn.representor_port.removeprefix("ports/")
        plain = await c.create_flow_rule("c-plain", rule(c_port, forward("p0")))
        assert plain.tenant == "tenant-c"
        for name in ("flowRules/a-pushed", "flowRules/a-kept", "flowRules/c-plain"):
            await ops.delete_flow_rule(name)
        await a.delete_function("functions/up-a")
        await c.delete_function("functions/up-c")

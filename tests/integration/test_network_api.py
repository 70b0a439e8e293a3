"""NetworkService and `dpuctl port/flow` against an agent on the in-memory datapath.

The kernel datapath (tc flower) and real packets are tested in the VM suite.
"""

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

import host_client
from dpu_wire.v1 import network_pb2
from tests.integration.conftest import start_agent

pytestmark = pytest.mark.asyncio
BIN = Path(sys.executable).parent


def forward_rule(port="pf0vf0", to="pf0vf1", priority=10, **match):
    return network_pb2.FlowRule(
        priority=priority,
        ingress_port=f"ports/{port}",
        match=network_pb2.FlowMatch(**match),
        actions=[network_pb2.FlowAction(forward=network_pb2.ForwardAction(port=f"ports/{to}"))],
    )


@pytest.fixture
def memory_agent(tmp_path):
    env = {
        "DPU_AGENT_NETWORK_BACKEND": "memory",
        "DPU_AGENT_NETWORK_RULES_FILE": str(tmp_path / "r.json"),
    }
    agent = start_agent(tmp_path, env=env)
    yield agent, env
    if agent.proc.poll() is None:
        assert agent.terminate() == 0


async def test_rules_are_served_listed_and_survive_a_restart(memory_agent, tmp_path):
    agent, env = memory_agent
    async with host_client.Client(agent.address) as client:
        ports = await client.list_ports()
        assert [p.name for p in ports] == [
            "ports/p0",
            "ports/pf0vf0",
            "ports/pf0vf1",
            "ports/pf0vf2",
        ]
        assert ports[0].kind == network_pb2.PORT_KIND_UPLINK
        made = await client.create_flow_rule(
            "fwd-1", forward_rule(ip_protocol=17, ethertype=0x0800, dst_l4_port=53)
        )
        assert made.name == "flowRules/fwd-1"
        assert made.match.dst_l4_port == 53
        await client.create_flow_rule("fwd-2", forward_rule(port="pf0vf1", to="pf0vf0"))
        got = await client.get_flow_rule("flowRules/fwd-1")
        assert got.counters.packets == 0
        info = await client.agent_info()
        assert {c.service: c.available for c in info.capabilities}["dpu.v1.NetworkService"]
    agent.proc.kill()
    agent.proc.wait(10)
    again = start_agent(tmp_path, env=env)
    try:
        async with host_client.Client(again.address) as client:
            names = [r.name for r in await client.list_flow_rules()]
            assert names == ["flowRules/fwd-1", "flowRules/fwd-2"]
            await client.delete_flow_rule("flowRules/fwd-2")
            assert [r.name for r in await client.list_flow_rules()] == ["flowRules/fwd-1"]
    finally:
        assert again.terminate() == 0


@pytest.mark.parametrize(
    ("rule", "fragment"),
    [
        (forward_rule(dst_l4_port=80), "L4 port needs ip_protocol"),
        (forward_rule(to="pf0vf0"), "its own ingress port"),
        (forward_rule(priority=0), "priority must be"),
        (forward_rule(dst_ip_prefix="10.0.0.1/8"), "host bits set"),
    ],
)
async def test_bad_rules_are_invalid_argument_and_change_nothing(memory_agent, rule, fragment):
    agent, _ = memory_agent
    async with host_client.Client(agent.address) as client:
        with pytest.raises(host_client.InvalidArgumentError, match=fragment):
            await client.create_flow_rule("bad", rule)
        assert await client.list_flow_rules() == []


@pytest.mark.parametrize("rule", [forward_rule(to="nope"), forward_rule(port="nope")])
async def test_a_rule_naming_a_port_that_does_not_exist_is_not_found(memory_agent, rule):
    agent, _ = memory_agent
    async with host_client.Client(agent.address) as client:
        with pytest.raises(host_client.NotFoundError) as missing:
            await client.create_flow_rule("bad", rule)
        assert missing.value.message == "ports/nope does not exist"
        assert await client.list_flow_rules() == []


async def test_dpuctl_port_and_flow_commands(memory_agent):
    agent, _ = memory_agent

    def dpuctl(*args):
        return subprocess.run(
            [str(BIN / "dpuctl"), "--target", agent.address, *args],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    ports = dpuctl("port", "list")
    assert "ports/pf0vf0" in ports.stdout
    assert "representor" in ports.stdout
    matches = ["--match", "ethertype=0x0800", "--match", "ip_proto=tcp", "--match", "dst_port=80"]
    actions = ["--action", "count", "--action", "forward=pf0vf1"]
    added = dpuctl("flow", "add", "web", "--port", "pf0vf0", "--priority", "5", *matches, *actions)
    assert added.returncode == 0, added.stderr
    assert "flowRules/web" in dpuctl("flow", "list").stdout
    stats = dpuctl("flow", "stats", "web")
    assert "0 packets" in stats.stdout
    bad = dpuctl("flow", "add", "x", "--port", "pf0vf0", "--priority", "6", "--action", "teleport")
    assert bad.returncode == 2
    assert "expected forward=PORT" in bad.stderr
    gone = dpuctl("flow", "del", "web")
    assert gone.returncode == 0, gone.stderr
    assert "no flow rules" in dpuctl("flow", "list").stdout


async def test_without_a_backend_the_service_says_why(agent):
    async with host_client.Client(agent.address) as client:
        with pytest.raises(
            host_client.UnimplementedError, match=r"no network backend is configured"
        ):
            await client.list_ports()


async def test_a_tenant_holds_a_bounded_number_of_counter_watches(memory_agent):
    agent, _ = memory_agent
    async with host_client.Client(agent.address) as client:
        await client.create_flow_rule("w-1", forward_rule())
        request = network_pb2.WatchFlowCountersRequest(names=["flowRules/w-1"])
        watches = [client.stubs.network.WatchFlowCounters(request) for _ in range(16)]
        try:
            for watch in watches:
                first = await watch.read()
                assert isinstance(first, network_pb2.FlowCounterUpdate)
                assert first.name == "flowRules/w-1"
            extra = client.stubs.network.WatchFlowCounters(request)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await extra.read()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "16 streams" in (refused.value.details() or "")
            watches.pop().cancel()  # a slot comes back once the agent sees the cancel
            async with asyncio.timeout(10):
                while True:
                    again = client.stubs.network.WatchFlowCounters(request)
                    watches.append(again)
                    try:
                        update = await again.read()
                        assert isinstance(update, network_pb2.FlowCounterUpdate)
                        assert update.name == "flowRules/w-1"
                        break
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                            raise
                    await asyncio.sleep(0.05)
        finally:
            for watch in watches:
                watch.cancel()


def named(name, rule):
    rule.name = f"flowRules/{name}"
    return rule


async def test_a_bulk_apply_takes_whole_or_not_at_all(memory_agent, tmp_path):
    agent, _ = memory_agent
    saved = tmp_path / "r.json"
    async with host_client.Client(agent.address) as client:
        await client.create_flow_rule("keep", forward_rule(priority=1))
        await client.create_flow_rule("change", forward_rule(priority=2))
        await client.create_flow_rule("drop-me", forward_rule(priority=3))
        before, text = await client.list_flow_rules(), saved.read_text()
        creates = [named(f"new-{n}", forward_rule(priority=100 + n)) for n in range(50)]
        bad = [
            (forward_rule(priority=150, dst_l4_port=80), host_client.InvalidArgumentError),
            (forward_rule(priority=1), host_client.AlreadyExistsError),  # keep's
            (forward_rule(to="nope", priority=151), host_client.NotFoundError),
        ]
        for rule, error in bad:
            middle = [*creates[:25], named("bad", rule), *creates[25:]]
            with pytest.raises(error):
                await client.apply_flow_rules(
                    middle, [named("change", forward_rule(priority=20))], ["flowRules/drop-me"]
                )
            assert await client.list_flow_rules() == before
            assert saved.read_text() == text
        checked = await client.apply_flow_rules(creates, validate_only=True)
        assert len(checked.created) == 50
        assert await client.list_flow_rules() == before
        done = await client.apply_flow_rules(
            creates, [named("change", forward_rule(priority=3))], ["flowRules/drop-me"]
        )  # change takes drop-me's priority in the same unit
        assert [r.name for r in done.updated] == ["flowRules/change"]
        assert list(done.deleted) == ["flowRules/drop-me"]
        names = [r.name for r in await client.list_flow_rules()]
        assert len(names) == 52
        assert "flowRules/drop-me" not in names
        assert (await client.get_flow_rule("flowRules/change")).priority == 3
        with pytest.raises(host_client.InvalidArgumentError, match="more than once"):
            await client.apply_flow_rules([], [], ["flowRules/keep", "flowRules/keep"])


RULE_SET = """\
rules:
  - name: web
    ingress_port: pf0vf0
    priority: 5
    match: {ethertype: 0x0800, ip_protocol: 6, dst_l4_port: 80}
    actions: [count, forward=pf0vf1]
  - name: back
    ingress_port: pf0vf1
    priority: 5
    actions: [{forward: {port: pf0vf0}}]
"""


async def test_dpuctl_flow_apply_shows_the_diff_and_applies_it(memory_agent, tmp_path):
    agent, _ = memory_agent

    def dpuctl(*args):
        return subprocess.run(
            [str(BIN / "dpuctl"), "--target", agent.address, "flow", *args],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    assert (
        dpuctl("add", "old", "--port", "p0", "--priority", "9", "--action", "drop").returncode == 0
    )
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULE_SET)
    dry = dpuctl("apply", str(rules), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "+ flowRules/web" in dry.stdout
    assert "+ flowRules/back" in dry.stdout
    assert "dry run, checked by the agent: 2 to create, 0 to update, 0 to delete" in dry.stdout
    assert "flowRules/web" not in dpuctl("list").stdout
    done = dpuctl("apply", str(rules))
    assert done.returncode == 0, done.stderr
    assert "applied: 2 to create" in done.stdout
    assert "nothing to change" in dpuctl("apply", str(rules)).stdout
    rules.write_text(RULE_SET.replace("priority: 5\n    match", "priority: 7\n    match"))
    changed = dpuctl("apply", str(rules), "--prune")
    assert changed.returncode == 0, changed.stderr
    assert "~ flowRules/web" in changed.stdout
    assert "- flowRules/old" in changed.stdout
    assert "1 to update, 1 to delete" in changed.stdout
    listed = dpuctl("list").stdout
    assert "flowRules/old" not in listed
    assert "prio 7" in listed
    rules.write_text(RULE_SET.replace("ingress_port: pf0vf1", "ingress_port: pf0vf2"))
    moved = dpuctl("apply", str(rules))
    assert moved.returncode == 0, moved.stderr
    assert "+ flowRules/back" in moved.stdout
    assert "- flowRules/back" in moved.stdout
    assert "ports/pf0vf2" in dpuctl("list").stdout
    rules.write_text(
        '{"rules": [{"name": "x", "ingress_port": "pf0vf0", "actions": ["teleport"]}]}'
    )
    bad = dpuctl("apply", str(rules))
    assert bad.returncode != 0
    assert "teleport" in bad.stderr

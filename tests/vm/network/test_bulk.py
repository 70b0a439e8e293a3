"""Bulk changes (`TcFlowBackend.apply`, `ApplyFlowRules`) against the kernel.

One netlink batch per change; a refusal half-way (an invalid rule, a filter the
kernel will not take) leaves the kernel's own filter dump as it was.
"""

from __future__ import annotations

import ipaddress
import json
import re

import pytest

import host_client
from dpu_agent.errors import FailedPrecondition, InvalidArgument
from dpu_agent.network.model import Count, Drop, FlowMatch, FlowRule, Forward, OffloadPolicy
from dpu_agent.network.tc_backend import COOKIE_MAGIC
from dpu_wire.v1 import network_pb2
from tests.integration.conftest import start_agent
from tests.vm.network.topology import DPU, filters_text, ping, sh

pytestmark = pytest.mark.tc


def drops(port: str, count: int, first_priority: int = 1, prefix: str = "drop") -> list[FlowRule]:
    """`count` drop rules no test packet matches (dst 10.99.x.y/32)."""
    return [
        FlowRule(
            f"{prefix}-{n}",
            first_priority + n,
            port,
            FlowMatch(
                dst_ip=ipaddress.ip_network(
                    f"10.{99 + n // 62500}.{n // 250 % 250}.{n % 250 + 1}/32"
                )
            ),
            (Drop(),),
        )
        for n in range(count)
    ]


def forwards(priority: int = 1000) -> list[FlowRule]:
    return [
        FlowRule("fwd-1-2", priority, "rep1", FlowMatch(), (Forward("rep2"),)),
        FlowRule("fwd-2-1", priority, "rep2", FlowMatch(), (Forward("rep1"),)),
    ]


def kernel_filters() -> str:
    """The kernel's dump of every rep's filters, without the action indexes (which a
    filter that is deleted and added back gets anew)."""
    return re.sub(r"index \d+", "index N", filters_text())


def ours(port: str) -> int:
    shown = sh("tc", "-n", DPU, "filter", "show", "dev", port, "ingress").stdout
    return shown.count("cookie " + COOKIE_MAGIC.hex())


def test_a_bulk_apply_carries_traffic_and_is_in_the_kernels_dump(backend):
    rules = [*drops("rep1", 200), *forwards()]
    backend.apply([], rules)
    assert ours("rep1") == 201
    assert ours("rep2") == 1
    assert {r.rule_id for r in backend.installed()} == {r.rule_id for r in rules}
    assert ping("h1", "10.10.0.2") == 3
    counted = FlowRule("fwd-1-2", 1000, "rep1", FlowMatch(), (Count(), Forward("rep2")))
    backend.apply([rules[-2]], [counted])  # replaced at the same priority in one batch
    assert ping("h1", "10.10.0.2") == 3
    assert backend.counters(counted).packets >= 3
    many = backend.counters_many([counted, rules[0], rules[-1]])
    one = backend.counters(counted)
    assert (many["fwd-1-2"].packets, many["fwd-1-2"].bytes) == (one.packets, one.bytes)
    assert many["drop-0"].packets == 0
    assert many["fwd-2-1"].packets >= 3
    backend.apply([*rules[:-2], counted, rules[-1]], [])
    assert ping("h1", "10.10.0.2") == 0
    assert ours("rep1") == ours("rep2") == 0


def test_a_kernel_refusal_half_way_leaves_the_kernel_as_before(backend):
    base = [*drops("rep1", 20), *forwards()]
    backend.apply([], base)
    before, installed = kernel_filters(), backend.installed()
    new = drops("rep1", 100, first_priority=100, prefix="new")
    new[50] = FlowRule("hw", 150, "rep1", FlowMatch(), (Drop(),), OffloadPolicy.HARDWARE_ONLY)
    with pytest.raises(FailedPrecondition, match=r"refused rule 'hw'.*not supported.*nothing"):
        backend.apply([*base[:10], base[-2]], new)  # deletes and adds, a refusal in the middle
    assert kernel_filters() == before
    assert backend.installed() == installed
    assert ping("h1", "10.10.0.2") == 3


def test_an_invalid_rule_half_way_changes_nothing(backend):
    base = [*drops("rep1", 20), *forwards()]
    backend.apply([], base)
    before = filters_text()
    new = drops("rep3", 100, prefix="new")
    new[50] = FlowRule("bad", 51, "rep3", FlowMatch(ip_protocol=17), (Drop(),))
    with pytest.raises(InvalidArgument, match="ip_protocol needs"):
        backend.apply(base[:10], new)
    assert filters_text() == before


def test_ten_thousand_rules_go_in_and_out_in_one_call_each(backend):
    rules = drops("rep3", 10_000)
    backend.apply([], rules)
    assert ours("rep3") == 10_000
    assert len(backend.installed()) == 10_000
    counted = backend.counters_many(rules)  # one dump of the port
    assert len(counted) == 10_000
    assert all(c.packets == 0 for c in counted.values())
    backend.apply(rules, [])
    assert ours("rep3") == 0


def forward_rule(
    name: str, src: str, dst: str, priority: int, **kw: object
) -> network_pb2.FlowRule:
    return network_pb2.FlowRule(
        name=f"flowRules/{name}",
        priority=priority,
        ingress_port=f"ports/{src}",
        actions=[network_pb2.FlowAction(forward=network_pb2.ForwardAction(port=f"ports/{dst}"))],
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.asyncio
async def test_apply_flow_rules_over_grpc_all_or_none(topology, tmp_path):
    saved = tmp_path / "flow-rules.json"
    env = {
        "DPU_AGENT_NETWORK_BACKEND": "tc",
        "DPU_AGENT_NETWORK_PORTS": "rep*",
        "DPU_AGENT_NETWORK_NETNS": topology.dpu,
        "DPU_AGENT_NETWORK_RULES_FILE": str(saved),
    }
    agent = start_agent(tmp_path, env=env)
    try:
        async with host_client.Client(agent.address) as client:
            there = [
                forward_rule("h1-h2", "rep1", "rep2", 10),
                forward_rule("h2-h1", "rep2", "rep1", 10),
            ]
            await client.apply_flow_rules(there)
            assert ping("h1", topology.ip("h2")) == 3
            before, text = kernel_filters(), saved.read_text()
            hardware = forward_rule(
                "hw", "rep3", "rep1", 5, offload=network_pb2.OFFLOAD_POLICY_HARDWARE_ONLY
            )
            more = [forward_rule(f"x-{n}", "rep3", "rep1", 100 + n) for n in range(40)]
            with pytest.raises(host_client.FailedPreconditionError, match="not supported"):
                await client.apply_flow_rules(
                    [*more[:20], hardware, *more[20:]], [], ["flowRules/h1-h2"]
                )
            assert kernel_filters() == before
            assert saved.read_text() == text
            assert ping("h1", topology.ip("h2")) == 3
            await client.apply_flow_rules(more, [], ["flowRules/h1-h2", "flowRules/h2-h1"])
            assert ping("h1", topology.ip("h2")) == 0
            assert len(json.loads(saved.read_text())["rules"]) == 40
            assert ours("rep3") == 40
            await client.apply_flow_rules([], [], [f"flowRules/x-{n}" for n in range(40)])
            assert ours("rep3") == 0
    finally:
        assert agent.terminate() == 0

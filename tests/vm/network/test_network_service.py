"""The agent's NetworkService on the tc datapath: rules over gRPC carry real packets,
and an agent restart keeps the rules and their counters counting."""

from __future__ import annotations

import pytest

import host_client
from dpu_wire.v1 import network_pb2
from tests.integration.conftest import start_agent
from tests.vm.network.topology import ping

pytestmark = [pytest.mark.tc, pytest.mark.asyncio]


def forward(src: str, dst: str, priority: int) -> network_pb2.FlowRule:
    return network_pb2.FlowRule(
        priority=priority,
        ingress_port=f"ports/{src}",
        actions=[
            network_pb2.FlowAction(count=network_pb2.CountAction()),
            network_pb2.FlowAction(forward=network_pb2.ForwardAction(port=f"ports/{dst}")),
        ],
    )


async def test_rules_over_grpc_carry_traffic_and_survive_a_restart(topology, tmp_path):
    env = {
        "DPU_AGENT_NETWORK_BACKEND": "tc",
        "DPU_AGENT_NETWORK_PORTS": "rep*",
        "DPU_AGENT_NETWORK_NETNS": topology.dpu,
        "DPU_AGENT_NETWORK_RULES_FILE": str(tmp_path / "flow-rules.json"),
    }
    agent = start_agent(tmp_path, env=env)
    try:
        async with host_client.Client(agent.address) as client:
            ports = [p.name for p in await client.list_ports()]
            assert ports == ["ports/rep1", "ports/rep2", "ports/rep3"]
            assert ping("h1", topology.ip("h2")) == 0, "no rule yet: nothing may pass"
            await client.create_flow_rule("h1-to-h2", forward("rep1", "rep2", 10))
            await client.create_flow_rule("h2-to-h1", forward("rep2", "rep1", 10))
            assert ping("h1", topology.ip("h2"), count=3) == 3
            before = (await client.get_flow_rule("flowRules/h1-to-h2")).counters.packets
            assert before >= 3
    finally:
        agent.proc.kill()  # no clean shutdown: the rules stay in the kernel
        agent.proc.wait(30)
    again = start_agent(tmp_path, env=env)
    try:
        async with host_client.Client(again.address) as client:
            names = [r.name for r in await client.list_flow_rules()]
            assert names == ["flowRules/h1-to-h2", "flowRules/h2-to-h1"]
            assert ping("h1", topology.ip("h2"), count=2) == 2
            after = (await client.get_flow_rule("flowRules/h1-to-h2")).counters.packets
            assert after >= before + 2, "the counters did not keep counting"
            with pytest.raises(host_client.InvalidArgumentError, match="own ingress port"):
                await client.create_flow_rule("loop", forward("rep1", "rep1", 20))
            await client.delete_flow_rule("flowRules/h1-to-h2")
            await client.delete_flow_rule("flowRules/h2-to-h1")
            assert ping("h1", topology.ip("h2")) == 0
    finally:
        assert again.terminate() == 0

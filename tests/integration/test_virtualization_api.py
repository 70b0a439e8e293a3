"""VirtualizationService, the SDK and `dpuctl function` against an agent on memory backends.

The `memory` function backend makes no devices; it exercises the service, the
manager's checks and transactions, and the wiring to the network and storage
services. The `linux` backend (veth pairs, namespaces, NBD and NVMe-oF over rxe0)
is tested with real devices in the VM suite (tests/vm/virtualization).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import host_client
from dpu_wire.v1 import network_pb2, virtualization_pb2
from tests.integration.conftest import start_agent

pytestmark = pytest.mark.asyncio
BIN = Path(sys.executable).parent
VF = virtualization_pb2.FUNCTION_TYPE_VF


@pytest.fixture
def agent(tmp_path):
    env = {
        "DPU_AGENT_NETWORK_BACKEND": "memory",
        "DPU_AGENT_VIRT_BACKEND": "memory",
        "DPU_AGENT_VIRT_STATE_FILE": str(tmp_path / "functions.json"),
        "DPU_AGENT_STORAGE_BACKEND": "memory",
    }
    process = start_agent(tmp_path, env=env)
    yield process, env
    if process.proc.poll() is None:
        assert process.terminate() == 0, process.log_path.read_text()


def forward(port, to):
    return network_pb2.FlowRule(
        priority=10,
        ingress_port=f"ports/{port}",
        actions=[network_pb2.FlowAction(forward=network_pb2.ForwardAction(port=f"ports/{to}"))],
    )


async def test_network_functions_get_representors_and_rules_pin_them(agent, tmp_path):
    process, env = agent
    async with host_client.Client(process.address) as client:
        info = await client.agent_info()
        caps = {c.service: c.available for c in info.capabilities}
        assert caps["dpu.v1.VirtualizationService"] is True
        a = await client.create_function(
            "guest-a",
            virtualization_pb2.Function(type=VF, mac_address="02:AA:00:00:00:01", mtu=9000),
        )
        assert a.name == "functions/guest-a"
        assert a.representor_port == "ports/pf0vf0"
        assert a.mac_address == "02:aa:00:00:00:01"
        assert a.mtu == 9000
        assert a.state == virtualization_pb2.FUNCTION_STATE_READY
        assert a.times.create_time.seconds > 0
        b = await client.create_function(
            "guest-b", virtualization_pb2.Function(type=VF, vlan_id=100, rate_limit_bps=10**7)
        )
        assert b.representor_port == "ports/pf0vf1"
        assert b.vlan_id == 100
        # the network service's rules act on the representors
        await client.create_flow_rule("a-to-b", forward("pf0vf0", "pf0vf1"))
        with pytest.raises(host_client.FailedPreconditionError, match="a-to-b"):
            await client.delete_function("functions/guest-b")  # the rule forwards to it
        await client.delete_flow_rule("flowRules/a-to-b")
        changed = await client.update_function(
            virtualization_pb2.Function(name="functions/guest-b", rate_limit_bps=2 * 10**7),
            ["rate_limit_bps"],
        )
        assert changed.rate_limit_bps == 2 * 10**7
        assert changed.vlan_id == 100  # not in the mask: unchanged
        listed = await client.list_functions()
        assert [f.name for f in listed] == ["functions/guest-a", "functions/guest-b"]
        await client.delete_function("functions/guest-b")
        with pytest.raises(host_client.NotFoundError):
            await client.get_function("functions/guest-b")
    # records survive a restart of the agent
    assert process.terminate() == 0
    again = start_agent(tmp_path, env=env)
    try:
        async with host_client.Client(again.address) as client:
            kept = await client.get_function("functions/guest-a")
            assert kept.representor_port == "ports/pf0vf0"
            assert kept.mtu == 9000
    finally:
        assert again.terminate() == 0


async def test_bad_functions_are_refused_with_the_field_named(agent):
    process, _ = agent
    async with host_client.Client(process.address) as client:
        cases = [
            (virtualization_pb2.Function(), "type"),
            (virtualization_pb2.Function(type=VF, mtu=20), "mtu"),
            (virtualization_pb2.Function(type=VF, vlan_id=4095), "vlan_id"),
            (virtualization_pb2.Function(type=VF, mac_address="01:00:5e:00:00:01"), "multicast"),
            (virtualization_pb2.Function(type=VF, rate_limit_bps=5), "rate_limit_bps"),
            (virtualization_pb2.Function(type=VF, volume="volumes/v"), "not a block function"),
            (
                virtualization_pb2.Function(type=virtualization_pb2.FUNCTION_TYPE_NVME),
                "needs a volume",
            ),
        ]
        for function, words in cases:
            with pytest.raises(host_client.InvalidArgumentError, match=words):
                await client.create_function("bad", function)
        assert await client.list_functions() == []
        made = await client.create_function("f", virtualization_pb2.Function(type=VF))
        again = await client.create_function("f", virtualization_pb2.Function(type=VF))
        assert again.name == made.name  # a retry with the same spec is the same function
        with pytest.raises(host_client.AlreadyExistsError):
            await client.create_function("f", virtualization_pb2.Function(type=VF, mtu=1400))
        with pytest.raises(host_client.InvalidArgumentError, match="update_mask"):
            await client.update_function(
                virtualization_pb2.Function(name="functions/f", volume="volumes/x"), ["volume"]
            )


async def test_a_block_function_owns_its_volume_until_it_is_deleted(agent):
    process, _ = agent
    nvme = virtualization_pb2.FUNCTION_TYPE_NVME
    async with host_client.Client(process.address) as client:
        with pytest.raises(host_client.NotFoundError):
            await client.create_function(
                "disk", virtualization_pb2.Function(type=nvme, volume="volumes/missing")
            )
        await client.create_volume("v1", 1 << 20)
        disk = await client.create_function(
            "disk", virtualization_pb2.Function(type=nvme, volume="volumes/v1")
        )
        assert disk.volume == "volumes/v1"
        assert disk.host_device == "/dev/memblk0"
        with pytest.raises(host_client.FailedPreconditionError, match="already exported"):
            await client.create_function(
                "disk2", virtualization_pb2.Function(type=nvme, volume="volumes/v1")
            )
        with pytest.raises(host_client.FailedPreconditionError, match="exported"):
            await client.delete_volume("volumes/v1")
        async with await client.open_session(transport="tcp") as session:
            buf = await session.alloc(4096, readable=True, writable=True)
            with pytest.raises(host_client.FailedPreconditionError, match="functions/disk"):
                await session.write_volume("volumes/v1", 0, buf.ref())
            await client.delete_function("functions/disk")
            await session.write_volume("volumes/v1", 0, buf.ref())  # free again
        await client.delete_volume("volumes/v1")


def dpuctl(address, *args):
    env = {**os.environ, "DPU_TARGET": address}
    return subprocess.run(
        [str(BIN / "dpuctl"), *args], capture_output=True, text=True, env=env, check=False
    )


async def test_dpuctl_function_add_list_set_del(agent):
    process, _ = agent
    made = dpuctl(process.address, "function", "add", "web", "--type", "virtio-net", "--vlan", "7")
    assert made.returncode == 0, made.stderr
    assert "functions/web" in made.stdout
    assert "port ports/pf0vf0" in made.stdout
    assert "vlan 7" in made.stdout
    listed = dpuctl(process.address, "function", "list")
    assert "functions/web" in listed.stdout
    assert "virtio-net" in listed.stdout
    changed = dpuctl(process.address, "function", "set", "web", "--no-vlan", "--mtu", "1400")
    assert changed.returncode == 0, changed.stderr
    assert "vlan" not in changed.stdout
    bad = dpuctl(process.address, "function", "add", "x", "--type", "nvme")
    assert bad.returncode != 0
    assert "needs a volume" in bad.stderr
    gone = dpuctl(process.address, "function", "del", "web")
    assert gone.returncode == 0, gone.stderr
    assert dpuctl(process.address, "function", "list").stdout.strip() == "no functions"

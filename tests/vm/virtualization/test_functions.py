"""Functions made by the agent's linux backend, checked with real packets and a real disk.

Two network functions are veth pairs whose host ends live in namespaces; they reach
each other only through flow rules on their representors. A block function exports a
volume over NVMe-oF/RDMA (rxe0); a filesystem made on the host side is found in the
volume after the function is deleted, read back through the storage API.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import tempfile
import time
from pathlib import Path

import pytest

import host_client
from dpu_wire.v1 import network_pb2, storage_pb2, virtualization_pb2
from tests.integration.conftest import start_agent
from tests.vm.network.topology import ns_socket, ping, sh
from tests.vm.virtualization.conftest import (
    EMPTY,
    NVMF_ADDRESS,
    NVMF_HOST_ADDRESS,
    PREFIX,
    kernel_state,
)

pytestmark = [pytest.mark.tc, pytest.mark.asyncio]
VF = virtualization_pb2.FUNCTION_TYPE_VF
A_IP, B_IP = "10.98.0.1", "10.98.0.2"
CALL_TIMEOUT = 120.0  # a hang guard: one function is ~10 ip/tc runs, slow under TCG


@pytest.fixture
def agent(clean_kernel, tmp_path):
    env = {
        "DPU_AGENT_NETWORK_BACKEND": "tc",
        "DPU_AGENT_NETWORK_PORTS": "pf*",
        "DPU_AGENT_NETWORK_NETNS": clean_kernel,
        "DPU_AGENT_VIRT_BACKEND": "linux",
        "DPU_AGENT_VIRT_HOST_NETNS_PREFIX": PREFIX,
        "DPU_AGENT_VIRT_NVMF_ADDRESS": NVMF_ADDRESS,
        "DPU_AGENT_VIRT_NVMF_HOST_ADDRESS": NVMF_HOST_ADDRESS,
        "DPU_AGENT_DATAPLANE_TRANSPORTS": "tcp",
        # SQLite needs a local filesystem (tmp_path may be on 9p with --basetemp)
        "DPU_AGENT_STORAGE_DIR": tempfile.mkdtemp(prefix="dpuv-store-"),
    }
    process = start_agent(tmp_path, env=env)
    yield process
    if process.proc.poll() is None:
        assert process.terminate() == 0, process.log_path.read_text()


def forward(src: str, dst: str) -> network_pb2.FlowRule:
    return network_pb2.FlowRule(
        priority=10,
        ingress_port=f"ports/{src}",
        actions=[network_pb2.FlowAction(forward=network_pb2.ForwardAction(port=f"ports/{dst}"))],
    )


def address(function: virtualization_pb2.Function, ip: str) -> str:
    netns = function.host_device.split("/")[0]
    sh("ip", "-n", netns, "addr", "add", f"{ip}/24", "dev", "eth0")
    return netns


async def connect_pair(client, a, b):
    rep_a, rep_b = (
        a.representor_port.removeprefix("ports/"),
        b.representor_port.removeprefix("ports/"),
    )
    await client.create_flow_rule("a-to-b", forward(rep_a, rep_b))
    await client.create_flow_rule("b-to-a", forward(rep_b, rep_a))


async def test_two_functions_reach_each_other_only_through_flow_rules(agent):
    async with host_client.Client(agent.address, timeout=CALL_TIMEOUT) as client:
        a = await client.create_function("a", virtualization_pb2.Function(type=VF))
        b = await client.create_function(
            "b", virtualization_pb2.Function(type=virtualization_pb2.FUNCTION_TYPE_VIRTIO_NET)
        )
        assert (a.representor_port, b.representor_port) == ("ports/pf0vf0", "ports/pf0vf1")
        assert a.host_device == f"{PREFIX}a/eth0"
        ports = [p.name for p in await client.list_ports()]
        assert ports == ["ports/pf0vf0", "ports/pf0vf1"]  # the network service sees them
        ns_a, _ = address(a, A_IP), address(b, B_IP)
        assert ping(ns_a, B_IP) == 0, "no flow rule yet: nothing may pass"
        await connect_pair(client, a, b)
        ping(ns_a, B_IP, count=1)  # re-resolves ARP (failed while there was no rule)
        assert ping(ns_a, B_IP, count=3) == 3
        with pytest.raises(host_client.FailedPreconditionError, match="flow rule"):
            await client.delete_function("functions/b")
        await client.delete_flow_rule("flowRules/a-to-b")
        await client.delete_flow_rule("flowRules/b-to-a")
        assert ping(ns_a, B_IP) == 0
        await client.delete_function("functions/a")
        await client.delete_function("functions/b")
    assert kernel_state() == EMPTY


async def test_vlans_separate_functions_until_they_match(agent):
    async with host_client.Client(agent.address, timeout=CALL_TIMEOUT) as client:
        a = await client.create_function("a", virtualization_pb2.Function(type=VF, vlan_id=100))
        b = await client.create_function("b", virtualization_pb2.Function(type=VF, vlan_id=200))
        ns_a, _ = address(a, A_IP), address(b, B_IP)
        await connect_pair(client, a, b)
        assert ping(ns_a, B_IP) == 0, "VLAN 100 reached a function on VLAN 200"
        await client.update_function(
            virtualization_pb2.Function(name="functions/b", vlan_id=100), ["vlan_id"]
        )
        ping(ns_a, B_IP, count=1)  # re-resolves ARP (failed while the VLANs differed)
        assert ping(ns_a, B_IP, count=3) == 3
        # on the DPU side the traffic is tagged: the representor sees VLAN 100 frames
        rule = network_pb2.FlowRule(
            priority=5,
            ingress_port="ports/pf0vf0",
            match=network_pb2.FlowMatch(vlan_id=100),
            actions=[
                network_pb2.FlowAction(count=network_pb2.CountAction()),
                network_pb2.FlowAction(forward=network_pb2.ForwardAction(port="ports/pf0vf1")),
            ],
        )
        await client.create_flow_rule("tagged", rule)
        assert ping(ns_a, B_IP, count=2) == 2
        counted = (await client.get_flow_rule("flowRules/tagged")).counters.packets
        assert counted >= 2
        for name in ("tagged", "a-to-b", "b-to-a"):
            await client.delete_flow_rule(f"flowRules/{name}")
        await client.delete_function("functions/a")
        await client.delete_function("functions/b")
    assert kernel_state() == EMPTY


def rx_bytes(netns: str) -> int:
    data = json.loads(sh("ip", "-n", netns, "-s", "-j", "link", "show", "eth0").stdout)
    return int(data[0]["stats64"]["rx"]["bytes"])


async def test_a_rate_limit_caps_what_the_function_sends(agent):
    rate_bps = 8_000_000
    async with host_client.Client(agent.address, timeout=CALL_TIMEOUT) as client:
        a = await client.create_function(
            "a", virtualization_pb2.Function(type=VF, rate_limit_bps=rate_bps)
        )
        b = await client.create_function("b", virtualization_pb2.Function(type=VF))
        ns_a, ns_b = address(a, A_IP), address(b, B_IP)
        await connect_pair(client, a, b)
        assert ping(ns_a, B_IP, count=2) == 2  # ARP settled before the flood
        payload = b"\x5a" * 1000
        frame_bytes = 14 + 20 + 8 + len(payload)
        with ns_socket(ns_a, socket.AF_INET, socket.SOCK_DGRAM) as sender:
            before = rx_bytes(ns_b)
            sent, start = 0, time.monotonic()
            while (elapsed := time.monotonic() - start) < 2.0:
                try:
                    sender.sendto(payload, (B_IP, 9))
                    sent += 1
                except OSError:  # ENOBUFS: the policer's drops push back; try again
                    continue
            await asyncio.sleep(0.2)
            delivered_bps = (rx_bytes(ns_b) - before) * 8 / elapsed
        offered_bps = sent * frame_bytes * 8 / elapsed
        assert offered_bps > 2 * rate_bps, f"offered only {offered_bps / 1e6:.1f} Mbit/s"
        # The kernel's policer does the work; this checks the backend configured it as asked.
        assert 0.5 * rate_bps <= delivered_bps <= 1.5 * rate_bps, (
            f"delivered {delivered_bps / 1e6:.2f} Mbit/s of {offered_bps / 1e6:.1f} offered,"
            f" limit {rate_bps / 1e6:.0f}"
        )
        await client.delete_flow_rule("flowRules/a-to-b")
        await client.delete_flow_rule("flowRules/b-to-a")
        await client.delete_function("functions/a")
        await client.delete_function("functions/b")


def is_block_device(path: str) -> bool:
    return Path(path).is_block_device()


@pytest.mark.usefixtures("block_ready")
async def test_a_block_function_is_a_disk_whose_files_land_in_the_volume(agent, tmp_path):
    marker = os.urandom(64 << 10)  # a file's content, to be found in the volume
    async with host_client.Client(agent.address, timeout=CALL_TIMEOUT) as client:
        await client.create_volume("disk0", 32 << 20, crc32c=True, compression="lz4")
        disk = await client.create_function(
            "disk0",
            virtualization_pb2.Function(
                type=virtualization_pb2.FUNCTION_TYPE_NVME, volume="volumes/disk0"
            ),
        )
        device = disk.host_device
        assert device.startswith("/dev/nvme"), device
        assert is_block_device(device)
        assert len(kernel_state()["subsystems"]) == 1
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        sh("mkfs.ext4", "-q", "-F", "-b", "4096", device)
        sh("mount", device, str(mnt))
        try:
            (mnt / "hello.bin").write_bytes(marker)
            sh("sync")
            with pytest.raises(host_client.FailedPreconditionError, match="mounted"):
                await client.delete_function("functions/disk0")
            with pytest.raises(host_client.FailedPreconditionError, match="exported"):
                await client.delete_volume("volumes/disk0")
        finally:
            sh("umount", str(mnt))
        await client.delete_function("functions/disk0")
        assert not is_block_device(device)
        assert kernel_state() == EMPTY
        image = bytearray()
        async with await client.open_session(transport="tcp") as session:
            buf = await session.alloc(1 << 20, writable=True)
            for offset in range(0, 32 << 20, 1 << 20):
                await session.read_volume("volumes/disk0", offset, buf.ref())
                image += buf.view
        assert image[1080:1082] == b"\x53\xef", "no ext4 superblock in the volume"
        assert marker in image, "the file written on the host side is not in the volume"
        await client.delete_volume("volumes/disk0")


@pytest.mark.usefixtures("block_ready")
async def test_a_block_functions_writes_keep_to_its_volumes_qos(agent):
    """The volume's QoS limits hold for the device's I/O, as for data-plane jobs.

    Direct 4 KiB writes from the host side (one at a time, as dd issues them), past a
    write IOPS limit's burst: the volume counts them throttled, and all succeed (a
    throttled request waits, it is never failed; the kernel's NBD timeout is off).
    """
    writes, limit = 60, 20  # the 1 s burst of 20 passes, the rest wait ~50 ms each
    async with host_client.Client(agent.address, timeout=CALL_TIMEOUT) as client:
        await client.create_volume("slow0", 8 << 20, qos=storage_pb2.QosLimits(write_iops=limit))
        disk = await client.create_function(
            "slow0",
            virtualization_pb2.Function(
                type=virtualization_pb2.FUNCTION_TYPE_NVME, volume="volumes/slow0"
            ),
        )
        device = disk.host_device
        try:
            sh("dd", "if=/dev/urandom", f"of={device}", "bs=4096", f"count={writes}",
               "oflag=direct", "status=none")  # fmt: skip
            stats = (await client.get_volume("volumes/slow0")).stats
        finally:
            await client.delete_function("functions/slow0")
        assert stats.write_ops >= writes, stats
        assert stats.throttled_ops >= writes - limit - 5, stats  # the burst's few refills
        await client.delete_volume("volumes/slow0")

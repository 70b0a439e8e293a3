"""Snapshots, clones and QoS over real gRPC and the tcp data plane: SDK, dpuctl, tenancy, quotas."""

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import field_mask_pb2

import host_client
from dpu_wire.v1 import storage_pb2
from tests.integration.conftest import start_agent
from tests.integration.pki import make_pki

MiB = 1 << 20
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_agent(tmp_path_factory, pki):
    agent = start_agent(
        tmp_path_factory.mktemp("snap-agent"),
        pki=pki,
        env={"DPU_AGENT_QUOTA_MAX_VOLUME_BYTES": str(6 * MiB)},
    )
    yield agent
    assert agent.terminate() == 0, agent.log_path.read_text()


def tenant(agent, pki, name, *, admin=False):
    return host_client.Client(agent.address, tls=pki.client(name, admin=admin), timeout=30)


@pytest.mark.asyncio
async def test_snapshot_clone_and_their_data_through_the_data_plane(agent):
    async with host_client.Client(agent.address) as client:
        await client.create_volume("src", 2 * MiB, crc32c=True, encryption="aes-xts-256")
        async with await client.open_session(transport="tcp") as session:
            buf = await session.alloc(MiB, readable=True, writable=True)
            first = os.urandom(MiB)
            buf.view[:] = first
            await session.write_volume("volumes/src", 0, buf, fua=True)
            snap = await client.create_snapshot("snap-1", "volumes/src")
            assert (snap.name, snap.source_volume) == ("snapshots/snap-1", "volumes/src")
            assert (snap.size_bytes, snap.allocated_bytes, snap.block_size) == (2 * MiB, MiB, 4096)
            assert snap.data_services.encryption == storage_pb2.ENCRYPTION_AES_XTS_256
            buf.view[:] = os.urandom(MiB)
            await session.write_volume("volumes/src", 0, buf, fua=True)
            clone = await client.clone_volume("clone-1", "snapshots/snap-1", size_bytes=4 * MiB)
            assert clone.source_snapshot == "snapshots/snap-1"
            assert clone.size_bytes == 4 * MiB
            assert clone.data_services.encryption == storage_pb2.ENCRYPTION_AES_XTS_256
            await session.read_volume("volumes/clone-1", 0, buf)
            assert buf.view == first
            assert [s.name for s in await client.list_snapshots("volumes/src")] == [
                "snapshots/snap-1"
            ]
            assert (await client.get_snapshot("snapshots/snap-1")).clones == ["volumes/clone-1"]
            with pytest.raises(host_client.FailedPreconditionError, match="has clones"):
                await client.delete_snapshot("snapshots/snap-1")
            await session.read_volume("volumes/clone-1", 0, buf)  # the refusal changed nothing
            assert buf.view == first
        await client.delete_volume("volumes/clone-1")
        await client.delete_snapshot("snapshots/snap-1")
        assert await client.list_snapshots() == []
        with pytest.raises(host_client.NotFoundError, match=r"snapshot 'snap-1' does not exist"):
            await client.get_snapshot("snapshots/snap-1")


@pytest.mark.asyncio
async def test_bad_snapshot_and_clone_requests_get_clear_answers(agent):
    async with host_client.Client(agent.address) as client:
        await client.create_volume("bad-src", MiB)
        with pytest.raises(host_client.NotFoundError, match="snapshot 'nope' does not exist"):
            await client.clone_volume("bad-clone", "snapshots/nope")
        with pytest.raises(host_client.InvalidArgumentError, match="source_snapshot"):
            await client.clone_volume("bad-clone", "volumes/bad-src")
        with pytest.raises(host_client.InvalidArgumentError, match=r"snapshot\.source_volume"):
            await client.create_snapshot("bad-snap", "bad-src")
        with pytest.raises(host_client.NotFoundError, match="volume 'none' does not exist"):
            await client.create_snapshot("bad-snap", "volumes/none")
        await client.create_snapshot("bad-snap", "volumes/bad-src")
        with pytest.raises(host_client.AlreadyExistsError):
            await client.create_snapshot("bad-snap", "volumes/bad-src")
        request = storage_pb2.CreateVolumeRequest(
            volume_id="bad-clone",
            volume=storage_pb2.Volume(source_snapshot="snapshots/bad-snap", block_size=512),
        )
        with pytest.raises(host_client.InvalidArgumentError, match="takes its block size"):
            await client._call(client.stubs.storage.CreateVolume, request)
        assert [v.name for v in await client.list_volumes() if "bad" in v.name] == [
            "volumes/bad-src"
        ]


@pytest.mark.asyncio
async def test_qos_limits_are_set_checked_changed_and_enforced(agent):
    async with host_client.Client(agent.address) as client:
        limits = storage_pb2.QosLimits(write_iops=20, read_bytes_per_second=1 << 20)
        made = await client.create_volume("qos-1", MiB, qos=limits)
        assert made.qos == limits
        too_low = storage_pb2.QosLimits(write_bytes_per_second=1000)
        with pytest.raises(host_client.InvalidArgumentError, match="out of range"):
            await client.set_volume_qos("volumes/qos-1", too_low)
        with pytest.raises(host_client.InvalidArgumentError, match="out of range"):
            await client.create_volume("qos-2", MiB, qos=too_low)
        assert (await client.get_volume("volumes/qos-1")).qos == limits  # unchanged
        with pytest.raises(host_client.InvalidArgumentError, match="cannot update 'size_bytes'"):
            await client._call(
                client.stubs.storage.UpdateVolume,
                storage_pb2.UpdateVolumeRequest(
                    volume=storage_pb2.Volume(name="volumes/qos-1", size_bytes=2 * MiB),
                    update_mask=field_mask_pb2.FieldMask(paths=["size_bytes"]),
                ),
            )
        async with await client.open_session(transport="tcp", queue_depth=8) as session:
            buffers = [await session.alloc(4096, readable=True) for _ in range(8)]

            async def writer(k: int) -> None:
                for i in range(6):
                    await session.write_volume("volumes/qos-1", (k * 6 + i) * 4096, buffers[k])

            await asyncio.gather(*(writer(k) for k in range(8)))  # 48 writes at 20 IOPS
        stats = (await client.get_volume("volumes/qos-1")).stats
        assert stats.write_ops == 48  # every throttled job ran: none failed or was dropped
        assert stats.throttled_ops >= 20
        assert stats.throttle_delay_us > 500_000
        metrics = agent.metrics()
        assert metrics['dpu_agent_volume_throttled_total{volume="qos-1"}'] == stats.throttled_ops
        assert metrics['dpu_agent_volume_qos_limit{limit="write_iops",volume="qos-1"}'] == 20
        changed = await client.set_volume_qos(
            "volumes/qos-1", storage_pb2.QosLimits(read_iops=7), fields=["read_iops"]
        )
        assert changed.qos == storage_pb2.QosLimits(
            read_iops=7, write_iops=20, read_bytes_per_second=1 << 20
        )


@pytest.mark.asyncio
async def test_tenants_see_only_their_snapshots_and_quotas_count_what_they_hold(tls_agent, pki):
    async with (
        tenant(tls_agent, pki, "tenant-a") as a,
        tenant(tls_agent, pki, "tenant-b") as b,
        tenant(tls_agent, pki, "ops", admin=True) as admin,
    ):
        await a.create_volume("a-vol", 2 * MiB)
        async with await a.open_session(transport="tcp") as session:
            buf = await session.alloc(2 * MiB, readable=True)
            buf.view[:] = os.urandom(2 * MiB)
            await session.write_volume("volumes/a-vol", 0, buf, fua=True)
        snap = await a.create_snapshot("a-snap", "volumes/a-vol")
        assert snap.tenant == "tenant-a"
        for call in (
            lambda c, n: c.get_snapshot(n),
            lambda c, n: c.delete_snapshot(n),
            lambda c, n: c.clone_volume("b-clone", n),
        ):
            with pytest.raises(host_client.NotFoundError) as theirs:
                await call(b, "snapshots/a-snap")
            with pytest.raises(host_client.NotFoundError) as missing:
                await call(b, "snapshots/no-snap")
            assert theirs.value.message.replace("a-snap", "X") == missing.value.message.replace(
                "no-snap", "X"
            )
        with pytest.raises(host_client.NotFoundError):
            await b.create_snapshot("b-snap", "volumes/a-vol")
        assert await b.list_snapshots() == []
        assert [s.tenant for s in await admin.list_snapshots()] == ["tenant-a"]
        # A holds 2 MiB of volume + 2 MiB the snapshot keeps; a 2 MiB clone makes 6 MiB
        await a.clone_volume("a-clone", "snapshots/a-snap")
        with pytest.raises(host_client.ResourceExhaustedError, match=r"quota\.max_volume_bytes"):
            await a.create_volume("a-more", MiB)
        with pytest.raises(host_client.ResourceExhaustedError, match=r"quota\.max_volume_bytes"):
            await a.clone_volume("a-clone-2", "snapshots/a-snap")
        await a.delete_volume("volumes/a-clone")
        admin_clone = await admin.clone_volume("ops-clone", "snapshots/a-snap")
        assert admin_clone.tenant == "tenant-a"  # a clone belongs to its snapshot's tenant
        assert [v.name for v in await a.list_volumes()] == ["volumes/a-vol", "volumes/ops-clone"]
        await admin.delete_volume("volumes/ops-clone")
        await a.delete_snapshot("snapshots/a-snap")
        await a.create_volume("a-more", MiB)  # room again
        metrics = tls_agent.metrics()
        # the deleted snapshot's blocks went back to the volume
        assert metrics['dpu_agent_volume_allocated_bytes{volume="a-vol"}'] == 2 * MiB
        assert metrics['dpu_agent_volume_allocated_bytes{volume="a-more"}'] == 0


def dpuctl(target, *args):
    return subprocess.run(
        [str(BIN / "dpuctl"), "--target", target, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_dpuctl_snapshot_clone_and_qos(agent):
    made = dpuctl(agent.address, "volume", "create", "cli-src", "--size", "4M", "--write-iops",
                  "500", "--read-bps", "100M")  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert "qos write_iops=500,read_bytes_per_second=104857600" in made.stdout
    snap = dpuctl(agent.address, "volume", "snapshot", "create", "cli-src", "cli-snap")
    assert snap.returncode == 0, snap.stderr
    assert "snapshots/cli-snap" in snap.stdout
    assert "of volumes/cli-src" in snap.stdout
    clone = dpuctl(agent.address, "volume", "clone", "cli-snap", "cli-clone", "--size", "8M")
    assert clone.returncode == 0, clone.stderr
    assert "clone of snapshots/cli-snap" in clone.stdout
    listed = dpuctl(agent.address, "volume", "snapshot", "list", "--volume", "cli-src")
    assert "clones volumes/cli-clone" in listed.stdout
    refused = dpuctl(agent.address, "volume", "snapshot", "delete", "cli-snap")
    assert refused.returncode == 1
    assert refused.stderr.startswith("dpuctl: FAILED_PRECONDITION")
    qos = dpuctl(agent.address, "volume", "qos", "cli-src", "--write-iops", "0", "--read-iops", "9")
    assert qos.returncode == 0, qos.stderr
    assert "qos read_iops=9,read_bytes_per_second=104857600" in qos.stdout
    nothing = dpuctl(agent.address, "volume", "qos", "cli-src")
    assert nothing.returncode == 1
    assert "give at least one of" in nothing.stderr
    assert dpuctl(agent.address, "volume", "delete", "cli-clone").returncode == 0
    gone = dpuctl(agent.address, "volume", "snapshot", "delete", "cli-snap")
    assert gone.returncode == 0, gone.stderr
    listed = dpuctl(agent.address, "--json", "volume", "snapshot", "list", "--volume", "cli-src")
    assert listed.stdout.strip() == "[]"

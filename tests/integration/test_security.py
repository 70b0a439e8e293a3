"""mTLS, tenants, ownership, admin-only calls and quotas, against a real agent process.

Every client here talks real gRPC over TLS (client certificates from a lab PKI made
with `dpuctl certs`' code); tenant B's attempts on tenant A's resources must answer
exactly as for resources that do not exist.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import crc32c
import grpc
import pytest

import host_client
from dpu_wire.capsule import JobKind, Span
from dpu_wire.v1 import job_pb2, network_pb2, session_pb2, virtualization_pb2
from tests.integration.conftest import start_agent, tokens_file
from tests.integration.pki import LabPki, make_pki

BIN = Path(sys.executable).parent
MiB = 1 << 20


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> LabPki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_agent(tmp_path_factory, pki):
    agent = start_agent(
        tmp_path_factory.mktemp("tls-agent"),
        pki=pki,
        env={"DPU_AGENT_NETWORK_BACKEND": "memory"},
    )
    yield agent
    assert agent.terminate() == 0, agent.log_path.read_text()


def tenant(agent, pki, name, *, admin=False, timeout=10.0):
    return host_client.Client(agent.address, tls=pki.client(name, admin=admin), timeout=timeout)


def same_answer(theirs: host_client.DpuError, missing: host_client.DpuError, a: str, b: str):
    """The two errors are the same code and message, but for the names in them."""
    assert theirs.code == missing.code == "NOT_FOUND"
    assert theirs.message.replace(a, "X") == missing.message.replace(b, "X")


# ------------------------------------------------------------------ the transport


@pytest.mark.asyncio
async def test_a_client_certificate_names_the_tenant(tls_agent, pki):
    async with tenant(tls_agent, pki, "tenant-a") as a:
        assert (await a.agent_info()).name.startswith("agents/")
        async with await a.open_session(transport="tcp", queue_depth=4) as session:
            assert (await a.get_session(session.name)).tenant == "tenant-a"
        volume = await a.create_volume("who-owns-me", MiB)
        assert volume.tenant == "tenant-a"
    access = [e for e in tls_agent.log_entries() if e.get("msg") == "rpc"]
    assert any(e.get("tenant") == "tenant-a" for e in access)


@pytest.mark.asyncio
async def test_without_a_client_certificate_the_handshake_fails(tls_agent, pki):
    no_cert = host_client.TlsConfig(ca=pki.ca)
    async with host_client.Client(tls_agent.address, tls=no_cert, timeout=5) as client:
        with pytest.raises(host_client.UnavailableError):
            await client.agent_info()


@pytest.mark.asyncio
async def test_a_certificate_from_another_ca_is_refused(tls_agent, pki, tmp_path):
    other = make_pki(tmp_path / "other")
    foreign = other.client("tenant-a")  # same tenant name, wrong CA
    mixed = host_client.TlsConfig(ca=pki.ca, cert=foreign.cert, key=foreign.key)
    async with host_client.Client(tls_agent.address, tls=mixed, timeout=5) as client:
        with pytest.raises(host_client.UnavailableError):
            await client.agent_info()


@pytest.mark.asyncio
async def test_plaintext_to_a_tls_agent_fails(tls_agent):
    async with host_client.Client(tls_agent.address, tls=False, timeout=5) as client:
        with pytest.raises(host_client.UnavailableError):
            await client.health()


def serve(*args, env=None):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DPU_AGENT_TLS_")}
    return subprocess.run(
        [str(BIN / "dpu-agent"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**environ, **(env or {})},
    )


@pytest.mark.parametrize("command", ["serve", "check-config"])
def test_no_tls_on_a_non_loopback_address_refuses_to_start(command, tmp_path):
    cfg = tmp_path / "agent.toml"
    cfg.write_text('[agent]\nlisten = "0.0.0.0:0"\n[tls]\nplaintext_loopback = true\n')
    proc = serve(command, "--config", str(cfg))
    assert proc.returncode == 2, proc.stderr
    assert "listens on 0.0.0.0:0, not loopback, and no TLS is configured" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_plaintext_must_be_asked_for_even_on_loopback(tmp_path):
    proc = serve("serve", "--listen", "127.0.0.1:0", env={"DPU_AGENT_STORAGE_DIR": str(tmp_path)})
    assert proc.returncode == 2
    assert "no TLS is configured" in proc.stderr
    assert "plaintext_loopback" in proc.stderr


def test_a_readable_key_is_refused(pki, tmp_path):
    key = tmp_path / "agent.key"
    key.write_bytes((pki.directory / "agent.key").read_bytes())
    key.chmod(0o644)
    env = {**pki.agent_env(), "DPU_AGENT_TLS_KEY": str(key)}
    proc = serve("check-config", env=env)
    assert proc.returncode == 2
    assert "may be read by group or others" in proc.stderr


@pytest.mark.asyncio
async def test_mtls_on_every_interface(tmp_path, pki):
    agent = start_agent(tmp_path, "--listen", "0.0.0.0:0", pki=pki)
    try:
        port = agent.address.rpartition(":")[2]
        async with host_client.Client(f"127.0.0.1:{port}", tls=pki.client("tenant-a")) as a:
            assert await a.health() == "SERVING"
        async with host_client.Client(f"127.0.0.1:{port}", tls=False, timeout=5) as plain:
            with pytest.raises(host_client.UnavailableError):
                await plain.health()
    finally:
        assert agent.terminate() == 0


# ------------------------------------------------------------------ volumes


@pytest.mark.asyncio
async def test_a_tenant_cannot_touch_another_tenants_volumes(tls_agent, pki):
    async with (
        tenant(tls_agent, pki, "tenant-a") as a,
        tenant(tls_agent, pki, "tenant-b") as b,
        tenant(tls_agent, pki, "ops", admin=True) as admin,
    ):
        await a.create_volume("a-vol", 2 * MiB)
        await b.create_volume("b-vol", MiB)
        for call in (
            lambda c, n: c.get_volume(n),
            lambda c, n: c.delete_volume(n),
            lambda c, n: c.resize_volume(n, 4 * MiB),
        ):
            with pytest.raises(host_client.NotFoundError) as theirs:
                await call(b, "volumes/a-vol")
            with pytest.raises(host_client.NotFoundError) as missing:
                await call(b, "volumes/no-vol")
            same_answer(theirs.value, missing.value, "a-vol", "no-vol")
        assert [v.name for v in await b.list_volumes()] == ["volumes/b-vol"]
        assert "volumes/a-vol" not in [v.name for v in await b.list_volumes()]
        async with await b.open_session(transport="tcp", queue_depth=2) as session:
            with pytest.raises(host_client.NotFoundError):
                await session.attach("volumes/a-vol")
            assert await session.attach("volumes/b-vol") > 0
        # A's volume is untouched, and the admin sees both with their owners
        assert (await a.get_volume("volumes/a-vol")).size_bytes == 2 * MiB
        owners = {v.name: v.tenant for v in await admin.list_volumes()}
        assert owners["volumes/a-vol"] == "tenant-a"
        assert owners["volumes/b-vol"] == "tenant-b"
        assert (await admin.get_volume("volumes/a-vol")).tenant == "tenant-a"
        # ids are agent-wide: B cannot take A's id (the one thing that tells it is taken)
        with pytest.raises(host_client.AlreadyExistsError):
            await b.create_volume("a-vol", MiB)


# ------------------------------------------------------------------ sessions and jobs


@pytest.mark.asyncio
async def test_a_tenant_cannot_see_or_touch_another_tenants_sessions_and_jobs(tls_agent, pki):
    async with (
        tenant(tls_agent, pki, "tenant-a") as a,
        tenant(tls_agent, pki, "tenant-b") as b,
        tenant(tls_agent, pki, "ops", admin=True) as admin,
        await a.open_session(transport="tcp", queue_depth=4) as sa,
    ):
        src = await sa.alloc(4096, readable=True)
        await sa.crc32c(src)
        job = await sa.submit_rpc("crc32c", src)
        await job
        job_name = f"{sa.name}/jobs/{job.job_id}"
        missing_session = "sessions/s-000000000000"
        missing_job = f"{missing_session}/jobs/{job.job_id}"
        for call, theirs_name, missing_name in (
            (b.get_session, sa.name, missing_session),
            (b.close_session, sa.name, missing_session),
            (b.list_jobs, sa.name, missing_session),
            (b.get_job, job_name, missing_job),
            (b.cancel_job, job_name, missing_job),
        ):
            with pytest.raises(host_client.NotFoundError) as theirs:
                await call(theirs_name)
            with pytest.raises(host_client.NotFoundError) as missing:
                await call(missing_name)
            same_answer(theirs.value, missing.value, sa.name, missing_session)
        stubs = b.stubs.sessions
        for method, request in (
            (
                stubs.AttachVolume,
                session_pb2.AttachVolumeRequest(session=sa.name, volume="volumes/x"),
            ),
            (stubs.RegisterKey, session_pb2.RegisterKeyRequest(session=sa.name, key=bytes(32))),
            (stubs.AdvertiseRegions, session_pb2.AdvertiseRegionsRequest(session=sa.name)),
            (stubs.WithdrawRegion, session_pb2.WithdrawRegionRequest(name=src.name)),
            (
                b.stubs.jobs.SubmitJob,
                job_pb2.SubmitJobRequest(
                    session=sa.name,
                    spec=job_pb2.JobSpec(crc32c=job_pb2.Crc32cJob(source=src.ref().region_ref())),
                ),
            ),
        ):
            with pytest.raises(host_client.NotFoundError):
                await b._call(method, request)
        watch = b.stubs.jobs.WatchCompletions(job_pb2.WatchCompletionsRequest(session=sa.name))
        with pytest.raises(grpc.aio.AioRpcError) as stream_error:
            async for _ in watch:
                pass
        assert stream_error.value.code() == grpc.StatusCode.NOT_FOUND
        assert sa.name not in [s.name for s in await b.list_sessions()]
        # the admin sees A's session and its jobs
        assert sa.name in [s.name for s in await admin.list_sessions()]
        assert (await admin.get_job(job_name)).name == job_name
        # and A's session still works
        src.view[:] = b"x" * 4096
        assert await sa.crc32c(src) == crc32c.crc32c(b"x" * 4096)
        assert (await a.get_session(sa.name)).state == session_pb2.SESSION_STATE_ACTIVE


@pytest.mark.asyncio
async def test_a_job_names_only_its_own_sessions_regions_and_volumes(tls_agent, pki):
    async with (
        tenant(tls_agent, pki, "tenant-a") as a,
        tenant(tls_agent, pki, "tenant-b") as b,
    ):
        await a.create_volume("a-private", MiB)
        async with (
            await a.open_session(transport="tcp", queue_depth=4) as sa,
            await a.open_session(transport="tcp", queue_depth=4) as sa2,
            await b.open_session(transport="tcp", queue_depth=4) as sb,
        ):
            secret = await sa.alloc(4096, readable=True, writable=True)
            secret.view[:] = b"s" * 4096
            handle = await sa.attach("volumes/a-private")
            mine = await sb.alloc(4096, readable=True, writable=True)
            # capsule path: B names A's region (its addr and rkey) as source, destination
            for job in (
                await sb.submit_copy(secret, mine),
                await sb.submit_copy(mine, secret),
                await sb.submit_crc32c(secret),
                await sa2.submit_crc32c(secret),  # same tenant, other session: refused too
            ):
                done = await job
                assert done.code == "INVALID_ARGUMENT", done
                assert "no region with rkey" in done.message
            assert mine.view != secret.view
            assert secret.view == b"s" * 4096
            # capsule path: B uses A's volume handle; B attached nothing
            read = await sb.submit(
                host_client.JobRequest(
                    JobKind.VOLUME_READ, Span(), mine.ref().span(), handle=handle
                )
            )
            done = await read
            assert done.code == "INVALID_ARGUMENT"
            assert f"no volume is attached to this session with handle {handle}" in done.message
            # gRPC path: a region name of another session, a volume not attached
            spec = job_pb2.JobSpec(crc32c=job_pb2.Crc32cJob(source=secret.ref().region_ref()))
            with pytest.raises(host_client.InvalidArgumentError, match=f"is not in {sb.name}"):
                await b._call(
                    b.stubs.jobs.SubmitJob, job_pb2.SubmitJobRequest(session=sb.name, spec=spec)
                )
            spec = job_pb2.JobSpec()
            spec.volume_read.volume = "volumes/a-private"
            spec.volume_read.destination.CopyFrom(mine.ref().region_ref())
            with pytest.raises(host_client.FailedPreconditionError, match="is not attached"):
                await b._call(
                    b.stubs.jobs.SubmitJob, job_pb2.SubmitJobRequest(session=sb.name, spec=spec)
                )


# ------------------------------------------------------------------ flow rules and ports


def forward_rule(port="pf0vf0", to="pf0vf1", priority=1010):  # tenants: 1000 and up
    return network_pb2.FlowRule(
        priority=priority,
        ingress_port=f"ports/{port}",
        actions=[network_pb2.FlowAction(forward=network_pb2.ForwardAction(port=f"ports/{to}"))],
    )


@pytest.mark.asyncio
async def test_a_tenant_cannot_touch_another_tenants_flow_rules(tls_agent, pki):
    async with (
        tenant(tls_agent, pki, "tenant-a") as a,
        tenant(tls_agent, pki, "tenant-b") as b,
        tenant(tls_agent, pki, "ops", admin=True) as admin,
    ):
        made = await a.create_flow_rule("a-rule", forward_rule(priority=1020))
        assert made.tenant == "tenant-a"
        await b.create_flow_rule("b-rule", forward_rule(port="pf0vf1", to="pf0vf0"))
        net = b.stubs.network
        update = network_pb2.UpdateFlowRuleRequest(
            flow_rule=network_pb2.FlowRule(name="flowRules/a-rule", priority=1030)
        )
        for method, request in (
            (net.GetFlowRule, network_pb2.GetFlowRuleRequest(name="flowRules/a-rule")),
            (net.DeleteFlowRule, network_pb2.DeleteFlowRuleRequest(name="flowRules/a-rule")),
            (net.UpdateFlowRule, update),
        ):
            with pytest.raises(host_client.NotFoundError) as theirs:
                await b._call(method, request)
            assert theirs.value.message == "flowRules/a-rule does not exist"
        watch = net.WatchFlowCounters(
            network_pb2.WatchFlowCountersRequest(names=["flowRules/a-rule"])
        )
        with pytest.raises(grpc.aio.AioRpcError) as stream_error:
            async for _ in watch:
                pass
        assert stream_error.value.code() == grpc.StatusCode.NOT_FOUND
        assert [r.name for r in await b.list_flow_rules()] == ["flowRules/b-rule"]
        # the same port and priority as A's rule: refused without naming A's rule
        with pytest.raises(host_client.AlreadyExistsError) as taken:
            await b.create_flow_rule("b-clash", forward_rule(priority=1020))
        assert "a-rule" not in taken.value.message
        assert (await a.get_flow_rule("flowRules/a-rule")).priority == 1020
        everything = {r.name: r.tenant for r in await admin.list_flow_rules()}
        assert everything == {"flowRules/a-rule": "tenant-a", "flowRules/b-rule": "tenant-b"}


@pytest.mark.asyncio
async def test_ports_and_uplink_rules_need_the_admin_role(tls_agent, pki):
    async with (
        tenant(tls_agent, pki, "tenant-b") as b,
        tenant(tls_agent, pki, "ops", admin=True) as admin,
    ):
        with pytest.raises(host_client.PermissionDeniedError, match="needs the admin role"):
            await b.list_ports()
        with pytest.raises(host_client.PermissionDeniedError, match="needs the admin role"):
            await b._call(b.stubs.network.GetPort, network_pb2.GetPortRequest(name="ports/p0"))
        with pytest.raises(host_client.PermissionDeniedError, match="uplink port p0"):
            await b.create_flow_rule("b-uplink", forward_rule(port="p0", to="pf0vf0"))
        assert "ports/p0" in [p.name for p in await admin.list_ports()]
        made = await admin.create_flow_rule("ops-uplink", forward_rule(port="p0", to="pf0vf0"))
        assert made.tenant == "ops"


# ------------------------------------------------------------------ quotas


QUOTAS = {
    "DPU_AGENT_QUOTA_MAX_VOLUMES": "2",
    "DPU_AGENT_QUOTA_MAX_VOLUME_BYTES": str(3 * MiB),
    "DPU_AGENT_QUOTA_MAX_SESSIONS": "2",
    "DPU_AGENT_QUOTA_MAX_QUEUE_DEPTH": "8",
    "DPU_AGENT_QUOTA_MAX_FLOW_RULES": "1",
    "DPU_AGENT_QUOTA_MAX_SNAPSHOTS": "2",
    "DPU_AGENT_NETWORK_BACKEND": "memory",
}


@pytest.fixture(scope="module")
def quota_agent(tmp_path_factory, pki):
    agent = start_agent(tmp_path_factory.mktemp("quota-agent"), pki=pki, env=QUOTAS)
    yield agent
    assert agent.terminate() == 0, agent.log_path.read_text()


@pytest.mark.asyncio
async def test_volume_quotas(quota_agent, pki):
    async with (
        tenant(quota_agent, pki, "tenant-a") as a,
        tenant(quota_agent, pki, "tenant-b") as b,
    ):
        with pytest.raises(host_client.ResourceExhaustedError, match=r"quota\.max_volume_bytes"):
            await a.create_volume("too-big", 4 * MiB)
        await a.create_volume("q-1", MiB)
        await a.create_volume("q-2", MiB)
        with pytest.raises(host_client.ResourceExhaustedError, match=r"quota\.max_volumes") as hit:
            await a.create_volume("q-3", MiB)
        assert "tenant 'tenant-a' would hold 3 volumes; its quota is 2" in hit.value.message
        with pytest.raises(host_client.ResourceExhaustedError, match=r"quota\.max_volume_bytes"):
            await a.resize_volume("volumes/q-1", 3 * MiB)
        assert (await a.resize_volume("volumes/q-1", 2 * MiB)).size_bytes == 2 * MiB
        # quotas are per tenant: B has its own
        await b.create_volume("q-b", MiB)
        await a.delete_volume("volumes/q-2")
        await a.create_volume("q-3", MiB)


@pytest.mark.asyncio
async def test_session_and_queue_depth_quotas(quota_agent, pki):
    async with (
        tenant(quota_agent, pki, "tenant-a") as a,
        tenant(quota_agent, pki, "tenant-b") as b,
    ):
        with pytest.raises(host_client.ResourceExhaustedError, match=r"quota\.max_queue_depth"):
            await a.open_session(transport="tcp", queue_depth=16)
        async with await a.open_session(transport="tcp", queue_depth=6):
            with pytest.raises(host_client.ResourceExhaustedError, match=r"quota\.max_queue_depth"):
                await a.open_session(transport="tcp", queue_depth=4)
            async with await a.open_session(transport="tcp", queue_depth=2):
                with pytest.raises(
                    host_client.ResourceExhaustedError, match=r"quota\.max_sessions"
                ):
                    await a.open_session(transport="tcp", queue_depth=1)
                async with await b.open_session(transport="tcp", queue_depth=8) as other:
                    assert other.name
        async with await a.open_session(transport="tcp", queue_depth=8) as again:
            assert again.name  # closed sessions give their quota back


@pytest.mark.asyncio
async def test_concurrent_opens_cannot_slip_past_the_session_quota(quota_agent, pki):
    async with tenant(quota_agent, pki, "tenant-c") as c:
        results = await asyncio.gather(
            *(c.open_session(transport="tcp", queue_depth=1) for _ in range(5)),
            return_exceptions=True,
        )
        sessions = [r for r in results if isinstance(r, host_client.Session)]
        refused = [r for r in results if isinstance(r, host_client.ResourceExhaustedError)]
        try:
            assert len(sessions) == 2
            assert len(refused) == 3
        finally:
            for session in sessions:
                await session.close()


@pytest.mark.asyncio
async def test_snapshot_quota_counts_snapshots_that_hold_nothing_and_outlive_their_volume(
    quota_agent, pki
):
    """A snapshot of an empty volume holds no bytes, and snapshots outlive their volume:
    without max_snapshots, create-snapshot-delete piled them up for free (an audit)."""
    async with (  # tenants of their own: the volume quota test leaves A at max_volumes
        tenant(quota_agent, pki, "tenant-c") as a,
        tenant(quota_agent, pki, "tenant-d") as b,
    ):
        await a.create_volume("sq", MiB)
        await a.create_snapshot("sq-1", "volumes/sq")
        await a.delete_volume("volumes/sq")
        await a.create_volume("sq", MiB)
        await a.create_snapshot("sq-2", "volumes/sq")
        with pytest.raises(host_client.ResourceExhaustedError, match="max_snapshots") as hit:
            await a.create_snapshot("sq-3", "volumes/sq")
        assert "tenant 'tenant-c' would hold 3 snapshots; its quota is 2" in hit.value.message
        assert {s.name for s in await a.list_snapshots()} == {"snapshots/sq-1", "snapshots/sq-2"}
        await b.create_volume("sq-b", MiB)  # per tenant: B has its own
        await b.create_snapshot("sq-b-1", "volumes/sq-b")
        await a.delete_snapshot("snapshots/sq-1")
        await a.create_snapshot("sq-3", "volumes/sq")
        for name in ("snapshots/sq-2", "snapshots/sq-3"):
            await a.delete_snapshot(name)
        await b.delete_snapshot("snapshots/sq-b-1")
        await a.delete_volume("volumes/sq")
        await b.delete_volume("volumes/sq-b")


@pytest.fixture(scope="module")
def default_quota_agent(tmp_path_factory, pki):
    """An agent with the default [quota] (the memory store: many creates, quickly;
    functions kept in memory, their block devices too)."""
    env = {
        "DPU_AGENT_STORAGE_BACKEND": "memory",
        "DPU_AGENT_NETWORK_BACKEND": "memory",
        "DPU_AGENT_VIRT_BACKEND": "memory",
    }
    agent = start_agent(tmp_path_factory.mktemp("default-quota-agent"), pki=pki, env=env)
    yield agent
    assert agent.terminate() == 0, agent.log_path.read_text()


@pytest.mark.asyncio
async def test_volumes_are_bounded_per_tenant_by_default(default_quota_agent, pki):
    """A volume holds no bytes until written, so without max_volumes (0 by default, and
    max_volume_bytes too) one tenant made volumes without end: ~380 a second, 3.4 KB of
    the agent's memory each, and every tenant's create and list walks all of them (an
    audit). max_volumes is 1024 by default; a clone is a volume and counts."""
    agent = default_quota_agent
    async with (
        tenant(agent, pki, "tenant-v", timeout=60.0) as v,
        tenant(agent, pki, "tenant-w") as w,
    ):
        await v.create_volume("dv-0", MiB)
        await v.create_snapshot("dv-snap", "volumes/dv-0")
        for first in range(1, 1024, 128):
            await asyncio.gather(
                *(v.create_volume(f"dv-{i}", MiB) for i in range(first, min(first + 128, 1024)))
            )
        with pytest.raises(host_client.ResourceExhaustedError, match="max_volumes") as hit:
            await v.create_volume("dv-1024", MiB)
        assert "tenant 'tenant-v' would hold 1025 volumes; its quota is 1024" in hit.value.message
        with pytest.raises(host_client.ResourceExhaustedError, match="max_volumes"):
            await v.clone_volume("dv-clone", "snapshots/dv-snap")
        await w.create_volume("dw-0", MiB)  # per tenant: W has its own
        await v.delete_volume("volumes/dv-1")
        await v.clone_volume("dv-clone", "snapshots/dv-snap")


@pytest.mark.asyncio
async def test_a_bad_size_is_invalid_argument_whatever_the_quota(quota_agent, pki):
    """The size is checked before the quota: with a quota set, 2^64-1 bytes answered
    RESOURCE_EXHAUSTED (quota.max_volume_bytes), and INVALID_ARGUMENT without one."""
    huge, unaligned = (1 << 64) - 1, MiB + 1
    async with tenant(quota_agent, pki, "tenant-e") as e:
        for size in (huge, unaligned, 4 << 40):  # not a block multiple; past the store's 1 TiB
            with pytest.raises(host_client.InvalidArgumentError):
                await e.create_volume("bad-size", size)
        await e.create_volume("bs", MiB)
        await e.create_snapshot("bs-snap", "volumes/bs")
        for size in (huge, unaligned):
            with pytest.raises(host_client.InvalidArgumentError):
                await e.resize_volume("volumes/bs", size)
            with pytest.raises(host_client.InvalidArgumentError):
                await e.clone_volume("bs-clone", "snapshots/bs-snap", size_bytes=size)
        await e.delete_volume("volumes/bs")
        await e.delete_snapshot("snapshots/bs-snap")


@pytest.fixture(scope="module")
def function_quota_agent(tmp_path_factory, pki):
    env = {
        "DPU_AGENT_QUOTA_MAX_FUNCTIONS": "2",
        "DPU_AGENT_NETWORK_BACKEND": "memory",
        "DPU_AGENT_VIRT_BACKEND": "memory",
    }
    agent = start_agent(tmp_path_factory.mktemp("function-quota-agent"), pki=pki, env=env)
    yield agent
    assert agent.terminate() == 0, agent.log_path.read_text()


@pytest.mark.asyncio
async def test_function_quota_is_per_tenant(function_quota_agent, pki):
    """One tenant made all 1,024 of the agent's functions and locked the others out (an
    audit); [quota] max_functions (64 by default) bounds each tenant's share."""
    vf = virtualization_pb2.Function(type=virtualization_pb2.FUNCTION_TYPE_VF)
    async with (
        tenant(function_quota_agent, pki, "tenant-f") as f,
        tenant(function_quota_agent, pki, "tenant-g") as g,
    ):
        await f.create_function("fq-1", vf)
        await f.create_function("fq-2", vf)
        with pytest.raises(host_client.ResourceExhaustedError, match="max_functions") as hit:
            await f.create_function("fq-3", vf)
        assert "tenant 'tenant-f' would hold 3 functions; its quota is 2" in hit.value.message
        await g.create_function("gq-1", vf)  # per tenant: G has its own
        await f.delete_function("functions/fq-1")
        await f.create_function("fq-3", vf)
        for name in ("functions/fq-2", "functions/fq-3"):
            await f.delete_function(name)
        await g.delete_function("functions/gq-1")


@pytest.mark.asyncio
async def test_block_functions_are_bounded_per_tenant_by_default(default_quota_agent, pki):
    """Each block function holds one of the kernel's NBD devices (16 by default) on the
    linux backend, and max_functions (64) let one tenant take them all (an audit);
    [quota] max_block_functions (4 by default) bounds its share."""
    nvme = virtualization_pb2.FUNCTION_TYPE_NVME
    async with (
        tenant(default_quota_agent, pki, "tenant-h") as h,
        tenant(default_quota_agent, pki, "tenant-i") as i,
    ):
        for n in range(5):
            await h.create_volume(f"hb-{n}", 1 << 20)
        for n in range(4):
            await h.create_function(
                f"hb-{n}", virtualization_pb2.Function(type=nvme, volume=f"volumes/hb-{n}")
            )
        with pytest.raises(host_client.ResourceExhaustedError, match="max_block_functions"):
            await h.create_function(
                "hb-4", virtualization_pb2.Function(type=nvme, volume="volumes/hb-4")
            )
        vf = virtualization_pb2.Function(type=virtualization_pb2.FUNCTION_TYPE_VF)
        await h.create_function("hv-0", vf)  # other functions are not block functions
        await i.create_volume("ib-0", 1 << 20)
        await i.create_function(  # per tenant: I has its own
            "ib-0", virtualization_pb2.Function(type=nvme, volume="volumes/ib-0")
        )
        for name in ("hv-0", "hb-0", "hb-1", "hb-2", "hb-3"):
            await h.delete_function(f"functions/{name}")
        await i.delete_function("functions/ib-0")


@pytest.mark.asyncio
async def test_flow_rule_quota(quota_agent, pki):
    async with tenant(quota_agent, pki, "tenant-a") as a:
        await a.create_flow_rule("fq-1", forward_rule(priority=1040))
        with pytest.raises(host_client.ResourceExhaustedError, match=r"quota\.max_flow_rules"):
            await a.create_flow_rule("fq-2", forward_rule(priority=1041))


# ------------------------------------------------------------------ tokens on loopback


@pytest.fixture(scope="module")
def token_agent(tmp_path_factory):
    directory = tmp_path_factory.mktemp("token-agent")
    path, tokens = tokens_file(directory, "tenant-a", admins=("ops",))
    agent = start_agent(
        directory,
        env={"DPU_AGENT_AUTH_TOKENS_FILE": str(path), "DPU_AGENT_NETWORK_BACKEND": "memory"},
    )
    yield agent, tokens["tenant-a"], tokens["ops"]
    assert agent.terminate() == 0, agent.log_path.read_text()


@pytest.mark.asyncio
async def test_bearer_tokens_on_plaintext_loopback(token_agent):
    agent, token_a, token_admin = token_agent
    async with host_client.Client(agent.address, tls=False, token="") as anonymous:
        assert await anonymous.health() == "SERVING"  # health needs no credentials
        with pytest.raises(host_client.PermissionDeniedError) as refused:
            await anonymous.list_volumes()
        assert refused.value.code == "UNAUTHENTICATED"
    wrong_token = "not-a-token"  # noqa: S105 - a wrong token on purpose
    async with host_client.Client(agent.address, tls=False, token=wrong_token) as wrong:
        with pytest.raises(host_client.PermissionDeniedError, match="not known"):
            await wrong.list_volumes()
    async with host_client.Client(agent.address, tls=False, token=token_a) as a:
        assert (await a.create_volume("tok-vol", MiB)).tenant == "tenant-a"
        with pytest.raises(host_client.PermissionDeniedError, match="admin role"):
            await a.list_ports()
    async with host_client.Client(agent.address, tls=False, token=token_admin) as admin:
        assert [p.name for p in await admin.list_ports()]
        assert (await admin.get_volume("volumes/tok-vol")).tenant == "tenant-a"


# ------------------------------------------------------------------ dpuctl and grpcurl


def test_dpuctl_over_mtls_with_options_and_environment(tls_agent, pki):
    def dpuctl(*args, env=None):
        return subprocess.run(
            [str(BIN / "dpuctl"), "--target", tls_agent.address, *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={**os.environ, **(env or {})},
        )

    made = dpuctl(*pki.cli_args("tenant-d"), "volume", "create", "cli-d", "--size", "1M")
    assert made.returncode == 0, made.stderr
    tls = pki.client("tenant-e")
    env = {"DPU_TLS_CA": str(tls.ca), "DPU_TLS_CERT": str(tls.cert), "DPU_TLS_KEY": str(tls.key)}
    listed = dpuctl("volume", "list", env=env)
    assert listed.returncode == 0, listed.stderr
    assert "cli-d" not in listed.stdout  # tenant-e does not see tenant-d's volume
    got = dpuctl("volume", "get", "cli-d", env=env)
    assert got.returncode == 1
    assert "NOT_FOUND" in got.stderr
    plain = dpuctl("--plaintext", "health", env=env)
    assert plain.returncode == 1
    assert "UNAVAILABLE" in plain.stderr


def test_grpcurl_with_a_client_certificate(tls_agent, pki):
    made = subprocess.run(
        [
            str(BIN / "dpuctl"),
            *("--target", tls_agent.address, *pki.cli_args("tenant-f")),
            *("volume", "create", "grpcurl-f", "--size", "1M"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert made.returncode == 0, made.stderr

    def grpcurl(who):
        tls = pki.client(who)
        return subprocess.run(
            [
                str(BIN / "grpcurl"),
                *("-cacert", str(tls.ca), "-cert", str(tls.cert), "-key", str(tls.key)),
                *(tls_agent.address, "dpu.v1.StorageService/ListVolumes"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    mine, theirs = grpcurl("tenant-f"), grpcurl("tenant-g")
    assert mine.returncode == theirs.returncode == 0, mine.stderr + theirs.stderr
    assert "volumes/grpcurl-f" in mine.stdout
    assert "volumes/grpcurl-f" not in theirs.stdout


# ------------------------------------------------------------------ limits a peer cannot lift


@pytest.mark.asyncio
async def test_completion_streams_and_watched_rules_are_bounded(tls_agent, pki):
    async with (
        tenant(tls_agent, pki, "tenant-h") as h,
        await h.open_session(transport="tcp", queue_depth=1) as session,
    ):
        streams = []  # the SDK holds one stream already; 15 more reach the limit of 16
        try:
            for _ in range(15):
                stream = h.stubs.jobs.WatchCompletions(
                    job_pb2.WatchCompletionsRequest(session=session.name)
                )
                await stream.initial_metadata()  # the agent sends it once the watch is in place
                streams.append(stream)
            extra = h.stubs.jobs.WatchCompletions(
                job_pb2.WatchCompletionsRequest(session=session.name)
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in extra:
                    pass
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "watched by 16 streams already" in (refused.value.details() or "")
        finally:
            for stream in streams:
                stream.cancel()
        names = [f"flowRules/r-{i}" for i in range(1001)]
        watch = h.stubs.network.WatchFlowCounters(network_pb2.WatchFlowCountersRequest(names=names))
        with pytest.raises(grpc.aio.AioRpcError) as too_many:
            async for _ in watch:
                pass
        assert too_many.value.code() == grpc.StatusCode.INVALID_ARGUMENT

"""The agent's API through the SDK, over real gRPC on a loopback socket."""

import asyncio
import os
import platform

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import host_client
from dpu_agent.stream_slots import MAX_STREAMS_PER_PEER
from dpu_wire.v1 import agent_pb2, job_pb2, job_pb2_grpc, network_pb2, session_pb2, storage_pb2

pytestmark = pytest.mark.asyncio
SERVING = health_pb2.HealthCheckResponse.SERVING


async def test_agent_info_describes_the_agent(agent):
    async with host_client.Client(agent.address) as client:
        info = await client.agent_info()
    assert info.name.startswith("agents/")
    assert info.api_version == "dpu.v1"
    assert info.machine == platform.machine()
    assert info.kernel == os.uname().release
    assert info.start_time.seconds > 0
    services = {c.service: c for c in info.capabilities}
    for name in ("AgentService", "SessionService", "JobService", "StorageService"):
        assert services[f"dpu.v1.{name}"].available
    assert list(info.transports) == [agent_pb2.TRANSPORT_TCP]  # no RDMA device on the host
    for name in (
        "NetworkService",
        "VirtualizationService",
    ):
        cap = services[f"dpu.v1.{name}"]
        assert not cap.available
        assert cap.reason


async def test_health_overall_and_per_service(agent):
    async with host_client.Client(agent.address) as client:
        assert await client.health() == "SERVING"
        assert await client.health("dpu.v1.AgentService") == "SERVING"
        assert await client.health("no.such.Service") == "SERVICE_UNKNOWN"


async def test_health_watch_streams_the_status(agent):
    """grpc.health.v1 Watch: its servicer writes with context.write (no async generator)."""
    async with grpc.aio.insecure_channel(agent.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        call = stub.Watch(health_pb2.HealthCheckRequest(service="dpu.v1.AgentService"))
        first = await asyncio.wait_for(call.read(), 10)
        call.cancel()
    assert first.status == health_pb2.HealthCheckResponse.SERVING


async def test_health_watches_without_credentials_are_bounded_per_connection(agent):
    """dpu_agent.stream_slots: a connection holds at most 8 such streams; one more is
    RESOURCE_EXHAUSTED at once, and a slot comes back when its stream ends."""
    async with grpc.aio.insecure_channel(agent.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="")
        held = [stub.Watch(request) for _ in range(MAX_STREAMS_PER_PEER)]
        for call in held:
            assert (await asyncio.wait_for(call.read(), 10)).status == SERVING
        extra = stub.Watch(request)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(extra.read(), 10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        held.pop().cancel()
        await asyncio.sleep(0.2)
        again = stub.Watch(request)
        assert (await asyncio.wait_for(again.read(), 10)).status == SERVING
        for call in [*held, again]:
            call.cancel()


async def test_planned_services_answer_unimplemented_with_a_reason(agent):
    async with host_client.Client(agent.address) as client:
        stubs = client.stubs
        with pytest.raises(host_client.UnimplementedError, match=r"NetworkService\.ListPorts"):
            await client._call(stubs.network.ListPorts, network_pb2.ListPortsRequest())


async def test_streaming_rpc_errors_map_like_unary_ones(agent):
    async with grpc.aio.insecure_channel(agent.address) as channel:
        stub = job_pb2_grpc.JobServiceStub(channel)
        call = stub.WatchCompletions(job_pb2.WatchCompletionsRequest(session="sessions/nope"))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "sessions/nope does not exist" in (info.value.details() or "")


@pytest.mark.parametrize(
    ("call", "request_msg", "fragment"),
    [
        ("storage.GetVolume", storage_pb2.GetVolumeRequest(name=""), "name is empty"),
        ("storage.GetVolume", storage_pb2.GetVolumeRequest(name="volumes/" + "a" * 300), "at most"),
        ("storage.CreateVolume", storage_pb2.CreateVolumeRequest(volume_id="UPPER"), "volume_id"),
        (
            "sessions.OpenSession",
            session_pb2.OpenSessionRequest(transport=77),  # type: ignore[arg-type]
            "unknown value 77",
        ),
        ("jobs.ListJobs", job_pb2.ListJobsRequest(session="sessions/s", page_size=-5), "negative"),
    ],
)
async def test_bad_input_is_invalid_argument_with_reason(agent, call, request_msg, fragment):
    async with host_client.Client(agent.address) as client:
        stub_name, method = call.split(".")
        with pytest.raises(host_client.InvalidArgumentError, match=fragment) as info:
            await client._call(getattr(getattr(client.stubs, stub_name), method), request_msg)
    assert info.value.request_id


async def test_request_id_reaches_the_agent_log(agent):
    async with host_client.Client(agent.address) as client:
        rid = "test-rid-0123456789"
        with pytest.raises(host_client.InvalidArgumentError) as info:
            await client._call(
                client.stubs.storage.GetVolume,
                storage_pb2.GetVolumeRequest(name=""),
                request_id=rid,
            )
    assert info.value.request_id == rid
    for _ in range(50):
        entries = [e for e in agent.log_entries() if e.get("request_id") == rid]
        if entries:
            break
        await asyncio.sleep(0.05)
    assert entries, "no log line carries the request id"
    assert entries[-1]["code"] == "INVALID_ARGUMENT"
    assert entries[-1]["method"] == "/dpu.v1.StorageService/GetVolume"


async def test_garbage_request_bytes_are_rejected_not_crashing(agent):
    async with grpc.aio.insecure_channel(agent.address) as channel:
        raw = channel.unary_unary("/dpu.v1.StorageService/GetVolume", None, None)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await raw(b"\xff\xff\xff\xff")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid message" in (info.value.details() or "")
    async with host_client.Client(agent.address) as client:
        assert await client.health() == "SERVING"


async def test_unknown_method_is_unimplemented(agent):
    async with grpc.aio.insecure_channel(agent.address) as channel:
        raw = channel.unary_unary("/dpu.v1.AgentService/NoSuchMethod", None, None)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await raw(b"")
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_unreachable_agent_is_unavailable_error():
    async with host_client.Client("127.0.0.1:1", timeout=5) as client:
        with pytest.raises(host_client.UnavailableError):
            await client.agent_info()
        with pytest.raises(host_client.UnavailableError, match=r"nothing listens at 127\.0\.0\.1"):
            await client.wait_ready(0.2)


async def test_client_is_reusable_but_not_reentrant(agent):
    client = host_client.Client(agent.address)
    async with client:
        with pytest.raises(RuntimeError, match="not re-entrant"):
            await client.__aenter__()
    async with client:
        assert (await client.agent_info()).api_version == "dpu.v1"
    with pytest.raises(RuntimeError, match="not open"):
        _ = client.stubs


async def test_a_request_id_reused_for_another_request_is_refused(agent):
    """Before, CreateVolume("ib") with the request_id of an earlier CreateVolume("ia")
    answered OK with volumes/ia, and ib was never made."""
    async with host_client.Client(agent.address) as client:
        stub = client.stubs.storage

        def create(volume_id: str) -> storage_pb2.CreateVolumeRequest:
            volume = storage_pb2.Volume(size_bytes=1 << 20)
            return storage_pb2.CreateVolumeRequest(
                volume_id=volume_id, volume=volume, request_id="rid-reused"
            )

        first = await client._call(stub.CreateVolume, create("ia"))
        assert first.name == "volumes/ia"
        with pytest.raises(host_client.InvalidArgumentError, match="another CreateVolume"):
            await client._call(stub.CreateVolume, create("ib"))
        assert (await client._call(stub.CreateVolume, create("ia"))).name == "volumes/ia"
        assert [v.name for v in await client.list_volumes()] == ["volumes/ia"]

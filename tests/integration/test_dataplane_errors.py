"""Bad capsules, backpressure, deadlines, cancellation and RPC job management (tcp)."""

import asyncio

import grpc
import pytest

import host_client
from dpu_wire import capsule
from dpu_wire.capsule import JobKind
from dpu_wire.v1 import job_pb2, storage_pb2
from tests.integration.conftest import start_agent
from tests.scenarios import bad_capsules

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def slow_agent(tmp_path_factory):
    """An agent moving 4 KiB per RDMA op, so a 4 MiB job takes a while."""
    process = start_agent(tmp_path_factory.mktemp("slow"), env={"DPU_AGENT_CHUNK_SIZE": "4096"})
    yield process
    assert process.terminate() == 0, process.log_path.read_text()


async def test_bad_capsules_get_error_completions_and_the_session_survives(agent):
    async with host_client.Client(agent.address) as client:
        await bad_capsules.run(client, "tcp")


async def test_rpc_submit_answers_resource_exhausted_when_full_and_waits_on_request(slow_agent):
    async with (
        host_client.Client(slow_agent.address) as client,
        await client.open_session(transport="tcp", queue_depth=2) as session,
    ):
        src = await session.alloc(4 << 20, readable=True)
        dst = await session.alloc(4 << 20, writable=True)
        spec = job_pb2.JobSpec()
        spec.copy.source.CopyFrom(src.ref().region_ref())
        spec.copy.destination.CopyFrom(dst.ref().region_ref())
        request = job_pb2.SubmitJobRequest(session=session.name, spec=spec)
        jobs = [await client._call(client.stubs.jobs.SubmitJob, request) for _ in range(2)]
        with pytest.raises(host_client.ResourceExhaustedError, match="queue slots are in use"):
            await client._call(client.stubs.jobs.SubmitJob, request)
        request.wait_for_slot = True
        third = await client._call(client.stubs.jobs.SubmitJob, request)
        assert third.job_id > jobs[-1].job_id
        listed = await client._call(
            client.stubs.jobs.ListJobs, job_pb2.ListJobsRequest(session=session.name)
        )
        assert len(listed.jobs) == 3


async def test_a_submit_whose_caller_left_while_it_waited_for_a_slot_never_runs(agent):
    """An abandoned wait_for_slot SubmitJob stayed queued and ran later, and its retry
    with the same request_id, waiting too, became a second job (an outside audit).
    Now a caller that goes away is withdrawn, and a retry joins the waiting request."""
    async with (
        host_client.Client(agent.address) as client,
        await client.open_session(transport="tcp", queue_depth=1) as session,
    ):
        await client.create_volume("slot-blocker", 2 << 20)
        limit = storage_pb2.QosLimits(write_bytes_per_second=64 << 10)
        await client.set_volume_qos("volumes/slot-blocker", limit)
        src = await session.alloc(1 << 20, readable=True)
        # the session's one slot: a write the volume's QoS makes wait about 15 s
        blocker = await session.submit_volume_write("volumes/slot-blocker", 0, src)
        running = job_pb2.JOB_STATE_RUNNING  # the capsule and the RPCs below take other ways
        while not [j for j in await client.list_jobs(session.name) if j.state == running]:  # noqa: ASYNC110 - polling another process
            await asyncio.sleep(0.05)
        spec = job_pb2.JobSpec()
        spec.crc32c.source.CopyFrom(src[:4096].region_ref())
        left = job_pb2.SubmitJobRequest(
            session=session.name, spec=spec, request_id="left", wait_for_slot=True
        )
        for _ in range(2):  # the first attempt and its retry both give up
            with pytest.raises(grpc.aio.AioRpcError) as gave_up:
                await client.stubs.jobs.SubmitJob(left, timeout=0.5)
            assert gave_up.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        joined = job_pb2.SubmitJobRequest(
            session=session.name, spec=spec, request_id="joined", wait_for_slot=True
        )
        calls = [
            asyncio.create_task(client._call(client.stubs.jobs.SubmitJob, joined)) for _ in range(2)
        ]
        await asyncio.sleep(0.3)
        other = job_pb2.SubmitJobRequest()
        other.CopyFrom(joined)
        other.spec.crc32c.source.CopyFrom(src[4096:8192].region_ref())
        with pytest.raises(host_client.InvalidArgumentError, match="another SubmitJob"):
            await client._call(client.stubs.jobs.SubmitJob, other)  # the key, not the request
        await session.cancel(blocker)  # the slot frees
        first, retry = await asyncio.gather(*calls)
        assert first.name == retry.name  # one job for both callers
        await asyncio.sleep(0.5)
        jobs = await client.list_jobs(session.name)
        assert [j.request_id for j in jobs if j.request_id in ("left", "joined")] == ["joined"]
        await client.delete_volume("volumes/slot-blocker")


async def test_capsules_beyond_the_credits_are_refused_not_dropped(slow_agent):
    async with (
        host_client.Client(slow_agent.address) as client,
        await client.open_session(transport="tcp", queue_depth=2) as session,
    ):
        src = await session.alloc(4 << 20, readable=True)
        dst = await session.alloc(4 << 20, writable=True)
        futures = {}
        for job_id in (201, 202, 203):
            future = asyncio.get_running_loop().create_future()
            session._pending[job_id] = (future, False)
            futures[job_id] = future
            message = capsule.Submit(job_id, JobKind.COPY, src.ref().span(), dst.ref().span())
            session._link.send([message.encode()])
        results = {job_id: await asyncio.wait_for(f, 60) for job_id, f in futures.items()}
        assert results[203].code == "RESOURCE_EXHAUSTED"
        assert results[201].ok
        assert results[202].ok


async def test_deadline_and_cancel(slow_agent):
    async with (
        host_client.Client(slow_agent.address) as client,
        await client.open_session(transport="tcp", queue_depth=4) as session,
    ):
        src = await session.alloc(4 << 20, readable=True)
        dst = await session.alloc(4 << 20, writable=True)
        late = await (await session.submit_copy(src, dst, deadline=0.001))
        assert (late.state, late.code) == ("FAILED", "DEADLINE_EXCEEDED")
        with pytest.raises(host_client.DeadlineExceededError):
            late.raise_for_status()
        job = await session.submit_copy(src, dst)
        await session.cancel(job)
        cancelled = await job
        assert (cancelled.state, cancelled.code) == ("CANCELLED", "CANCELLED")
        assert cancelled.bytes_written < 4 << 20
        rpc_job = await session.submit_rpc("copy", src, dst)
        await session.cancel(rpc_job)
        assert (await rpc_job).state == "CANCELLED"
        got = await client._call(
            client.stubs.jobs.GetJob,
            job_pb2.GetJobRequest(name=f"{session.name}/jobs/{rpc_job.job_id}"),
        )
        assert got.state == job_pb2.JOB_STATE_CANCELLED
        assert got.completion.status.code == 1


async def test_rpc_submit_is_idempotent_on_request_id(agent):
    async with (
        host_client.Client(agent.address) as client,
        await client.open_session(transport="tcp") as session,
    ):
        src = await session.alloc(4096, readable=True)
        spec = job_pb2.JobSpec()
        spec.crc32c.source.CopyFrom(src.ref().region_ref())
        request = job_pb2.SubmitJobRequest(session=session.name, spec=spec, request_id="same-key")
        first = await client._call(client.stubs.jobs.SubmitJob, request)
        again = await client._call(client.stubs.jobs.SubmitJob, request)
        assert first.job_id == again.job_id
        # The same key for another request is refused, not answered with the first job
        other = await session.alloc(8192, readable=True)
        request.spec.crc32c.source.CopyFrom(other.ref().region_ref())
        with pytest.raises(host_client.InvalidArgumentError, match="another SubmitJob"):
            await client._call(client.stubs.jobs.SubmitJob, request)
        jobs = await client._call(
            client.stubs.jobs.ListJobs, job_pb2.ListJobsRequest(session=session.name)
        )
        assert [job.job_id for job in jobs.jobs] == [first.job_id]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"transport": "carrier-pigeon"}, host_client.InvalidArgumentError),
        ({"queue_depth": 0}, host_client.InvalidArgumentError),
        ({"transport": "tcp", "poll_spin": -0.001}, host_client.InvalidArgumentError),
        ({"transport": "tcp", "poll_spin": 1.001}, host_client.InvalidArgumentError),
        ({"transport": "verbs"}, host_client.FailedPreconditionError),
    ],
)
async def test_bad_session_requests(agent, kwargs, error):
    async with host_client.Client(agent.address) as client:
        with pytest.raises(error):
            await client.open_session(**kwargs)

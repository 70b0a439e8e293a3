"""Bad capsules, backpressure, deadlines, cancellation and RPC job management (tcp)."""

import asyncio

import pytest

import host_client
from dpu_wire import capsule
from dpu_wire.capsule import JobKind
from dpu_wire.v1 import job_pb2
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


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"transport": "carrier-pigeon"}, host_client.InvalidArgumentError),
        ({"queue_depth": 0}, host_client.InvalidArgumentError),
        ({"transport": "verbs"}, host_client.FailedPreconditionError),
    ],
)
async def test_bad_session_requests(agent, kwargs, error):
    async with host_client.Client(agent.address) as client:
        with pytest.raises(error):
            await client.open_session(**kwargs)

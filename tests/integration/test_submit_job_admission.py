"""What job.proto and storage.proto say about SubmitJob's admission and the limits.

An implementer found the docs said SubmitJob had "the same semantics" as a capsule
and left out limits the agent enforces; the comments now say how they differ. These
tests hold the agent to those comments (they pass on the code as it was).
"""

import pytest

import host_client
from dpu_wire.v1 import job_pb2

pytestmark = pytest.mark.asyncio

TiB = 1 << 40


async def test_submit_job_refusals_are_rpc_errors_and_make_no_job(agent):
    async with (
        host_client.Client(agent.address) as client,
        await client.open_session(transport="tcp") as session,
    ):
        src = await session.alloc(8192, readable=True)
        dst = await session.alloc(8192, writable=True)

        async def submit(spec):
            request = job_pb2.SubmitJobRequest(session=session.name, spec=spec)
            return await client._call(client.stubs.jobs.SubmitJob, request)

        copy = job_pb2.JobSpec()
        copy.copy.source.CopyFrom(src[:4096].region_ref())
        copy.copy.destination.CopyFrom(dst.ref().region_ref())
        with pytest.raises(host_client.InvalidArgumentError, match="differs from source"):
            await submit(copy)  # a capsule's would be a FAILED job with status 3

        unknown = job_pb2.JobSpec()
        unknown.crc32c.source.region = f"{session.name}/regions/nowhere"
        with pytest.raises(host_client.NotFoundError, match="not advertised"):
            await submit(unknown)

        flush = job_pb2.JobSpec()
        flush.volume_flush.volume = "volumes/never-attached"
        with pytest.raises(host_client.FailedPreconditionError, match="not attached"):
            await submit(flush)

        late = job_pb2.JobSpec()
        late.crc32c.source.CopyFrom(src.ref().region_ref())
        for seconds in (-1, 4294968):
            late.deadline.seconds = seconds
            with pytest.raises(host_client.InvalidArgumentError, match="4294967"):
                await submit(late)
        late.deadline.seconds = 4294967
        longest = await submit(late)

        assert [j.job_id for j in await client.list_jobs(session.name)] == [longest.job_id]


async def test_volume_size_and_key_limits(agent):
    async with host_client.Client(agent.address) as client:
        with pytest.raises(host_client.InvalidArgumentError, match="over the store's limit"):
            await client.create_volume("too-big", TiB + 4096)
        with pytest.raises(host_client.InvalidArgumentError, match="halves must differ"):
            await client.create_volume("same-halves", 4096, encryption="aes-xts-256", key=b"k" * 64)

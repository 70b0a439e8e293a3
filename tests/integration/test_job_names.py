"""A job has one name: GetJob answered `.../jobs/01` with job 1 (an outside review)."""

import pytest

import host_client

pytestmark = pytest.mark.asyncio


async def test_a_job_has_one_name(agent):
    async with (
        host_client.Client(agent.address) as client,
        await client.open_session(transport="tcp") as session,
    ):
        job = await session.submit_crc32c(await session.alloc(4096, readable=True))
        await job
        found = await client.get_job(f"{session.name}/jobs/{job.job_id}")
        assert found.job_id == job.job_id
        for other in (f"0{job.job_id}", f"00{job.job_id}"):
            with pytest.raises(host_client.InvalidArgumentError, match="canonical"):
                await client.get_job(f"{session.name}/jobs/{other}")
            with pytest.raises(host_client.InvalidArgumentError, match="canonical"):
                await client.cancel_job(f"{session.name}/jobs/{other}")

"""Page tokens continue only the request that returned them (AIP-158).

A page token was the base64 of the last id, so the agent took it on another List
method, another session's ListJobs and with another filter, and paged some other
list from the middle (an outside review).
"""

import pytest
import pytest_asyncio

import host_client
from dpu_wire.v1 import job_pb2, storage_pb2

pytestmark = pytest.mark.asyncio

MiB = 1 << 20
SUCCEEDED = job_pb2.JOB_STATE_SUCCEEDED


async def test_a_list_volumes_token_is_refused_by_list_snapshots(agent):
    async with host_client.Client(agent.address) as client:
        for n in range(2):
            await client.create_volume(f"tok-vol-{n}", MiB)
        stubs = client.stubs.storage
        first = await client._call(stubs.ListVolumes, storage_pb2.ListVolumesRequest(page_size=1))
        assert first.next_page_token
        with pytest.raises(host_client.InvalidArgumentError, match="another request"):
            await client._call(
                stubs.ListSnapshots,
                storage_pb2.ListSnapshotsRequest(page_token=first.next_page_token),
            )
        # the token still continues its own listing, with any page size
        rest = await client._call(
            stubs.ListVolumes,
            storage_pb2.ListVolumesRequest(page_size=50, page_token=first.next_page_token),
        )
        assert [v.name for v in [*first.volumes, *rest.volumes]] == [
            v.name for v in await client.list_volumes()
        ]


@pytest_asyncio.fixture
async def two_sessions(agent):
    """A client, a session with three finished jobs and another with one."""
    async with (
        host_client.Client(agent.address) as client,
        await client.open_session(transport="tcp") as session,
        await client.open_session(transport="tcp") as other,
    ):
        src = await session.alloc(4096, readable=True)
        for _ in range(3):
            await (await session.submit_crc32c(src))
        await (await other.submit_crc32c(await other.alloc(4096, readable=True)))
        yield client, session.name, other.name


async def first_page(client, request):
    page = await client._call(client.stubs.jobs.ListJobs, request)
    assert page.next_page_token
    return page


async def test_a_list_jobs_token_is_refused_on_another_session(two_sessions):
    client, session, other = two_sessions
    first = await first_page(client, job_pb2.ListJobsRequest(session=session, page_size=1))
    elsewhere = job_pb2.ListJobsRequest(session=other, page_token=first.next_page_token)
    with pytest.raises(host_client.InvalidArgumentError, match="another request"):
        await client._call(client.stubs.jobs.ListJobs, elsewhere)


async def test_a_list_jobs_token_is_refused_with_another_filter(two_sessions):
    client, session, _ = two_sessions
    asked = job_pb2.ListJobsRequest(session=session, page_size=1, state=SUCCEEDED)
    first = await first_page(client, asked)
    unfiltered = job_pb2.ListJobsRequest(session=session, page_token=first.next_page_token)
    with pytest.raises(host_client.InvalidArgumentError, match="another request"):
        await client._call(client.stubs.jobs.ListJobs, unfiltered)
    # the same request goes on, with any page size
    asked.page_token = first.next_page_token
    asked.page_size = 0
    rest = await client._call(client.stubs.jobs.ListJobs, asked)
    assert [j.job_id for j in [*first.jobs, *rest.jobs]] == [
        j.job_id for j in await client.list_jobs(session, SUCCEEDED)
    ]

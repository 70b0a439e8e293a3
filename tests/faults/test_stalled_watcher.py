"""A WatchCompletions stream whose reader stops: the agent ends it instead of holding its jobs.

A real agent over gRPC on loopback. The client opens a stream, never reads it while
30,000 jobs finish, then reads: gRPC's flow control stops the agent's writes after a few
thousand completions, the stream falls `WATCHER_BACKLOG` behind, and the agent drops
what it held for it and ends it with RESOURCE_EXHAUSTED.
"""

import asyncio

import grpc
import pytest

import host_client
from dpu_agent.dataplane.bus import WATCHER_BACKLOG
from dpu_wire.v1 import job_pb2
from tests.integration.conftest import start_agent

pytestmark = pytest.mark.asyncio

JOBS = 30_000


async def read_until_the_end(
    call: grpc.aio.UnaryStreamCall[job_pb2.WatchCompletionsRequest, job_pb2.Completion],
) -> tuple[int, grpc.StatusCode]:
    read = 0
    try:
        async for _ in call:
            read += 1
    except grpc.aio.AioRpcError as exc:
        return read, exc.code()
    return read, grpc.StatusCode.OK


async def test_a_stream_nobody_reads_is_ended_resource_exhausted(tmp_path):
    agent = start_agent(tmp_path)
    try:
        async with (
            host_client.Client(agent.address) as client,
            await client.open_session(transport="tcp", queue_depth=64) as session,
        ):
            source = await session.alloc(64, readable=True)
            request = session.crc32c_request(source)
            call = client.stubs.jobs.WatchCompletions(
                job_pb2.WatchCompletionsRequest(session=session.name)
            )
            await call.initial_metadata()
            for _ in range(JOBS // 64):
                for job in await session.submit_many([request] * 64):
                    (await job).raise_for_status()
            read, code = await asyncio.wait_for(read_until_the_end(call), 20)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert str(WATCHER_BACKLOG) in (await call.details())
            assert read < JOBS - WATCHER_BACKLOG  # what it held was dropped, not sent late
            assert isinstance(await session.crc32c(source), int)  # the session goes on
    finally:
        assert agent.terminate() == 0, agent.log_path.read_text()

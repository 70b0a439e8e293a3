"""Checks of sections 4 and 5 of docs/data-plane.md (failure, shutdown) and of the
SDK's lease (section 1.4)."""

from __future__ import annotations

import asyncio
import os
import time

import grpc

import host_client
from dpu_wire.v1 import job_pb2, session_pb2
from tests.conformance import wire
from tests.conformance.checks_session import _drain
from tests.conformance.harness import GRACE, PROMPT, TIMERS, Ctx, Sess, code_of, rid
from tests.conformance.shutdown import shutdown_scenario
from tests.conformance.wire import St

FAILED = session_pb2.SESSION_STATE_FAILED


async def _fail(session: Sess) -> int:
    """Break the data plane while a job runs; the job's id."""
    job = await session.slow_write()
    await asyncio.sleep(0.2)
    await session.break_data_plane()
    state = await session.wait_state(FAILED, 10)
    assert state.state == FAILED, state
    return job


async def failure_fails_jobs_and_session(ctx: Ctx) -> None:
    """DP-4-1."""
    session = await ctx.open()
    job = await _fail(session)
    state = await session.get()
    assert state.error.code == 14, state
    assert state.error.message.startswith("data plane failed"), state
    found = await session.job(job)
    assert found.state == job_pb2.JOB_STATE_FAILED, found
    assert found.completion.status.code == 14, found
    assert found.completion.status.message.startswith("data plane failed"), found


async def failed_stays_listed(ctx: Ctx) -> None:
    """DP-4-2 (issue 14, item 13): main profile (30 s) and short profile (2 s)."""
    session = await ctx.open()
    await _fail(session)
    failed_at = time.monotonic()
    await asyncio.sleep(1.5)  # the old agent forgot it after 0.3 to 1 s
    assert (await session.get()).state == FAILED
    listed = await session.stubs.sessions.ListSessions(
        session_pb2.ListSessionsRequest(page_size=1000)
    )
    assert session.name in [s.name for s in listed.sessions]
    assert time.monotonic() - failed_at < 30
    await session.close()
    # the short profile: orphan_timeout 1 s, failed_retention 2 s; a failed session's
    # watch streams end, so no host watches it, and it must not be reaped as orphaned
    timed = await ctx.open("short")
    await _fail(timed)
    failed_at = time.monotonic()
    await asyncio.sleep(TIMERS["failed_retention"] * 0.6)
    assert (await timed.get()).state == FAILED, "forgotten before failed_retention"
    for _ in range(1000):
        if await code_of(timed.get()) == grpc.StatusCode.NOT_FOUND:
            break
        await asyncio.sleep(0.02)
    gone = time.monotonic() - failed_at
    assert TIMERS["failed_retention"] - 0.1 <= gone <= TIMERS["failed_retention"] + PROMPT, gone


async def failed_watch_streams(ctx: Ctx) -> None:
    """DP-4-3."""
    session = await ctx.open()
    capsules = session.watch(job_pb2.JOB_ORIGIN_CAPSULE)
    await capsules.initial_metadata()
    rpc_job = await session.slow_rpc()
    capsule_job = await _fail(session)
    lease, lease_code = await asyncio.wait_for(_drain(session.lease), 10)
    got, code = await asyncio.wait_for(_drain(capsules), 10)
    assert [(m.job_id, m.status.code) for m in lease] == [(rpc_job, 14)], lease
    assert lease_code == grpc.StatusCode.UNAVAILABLE
    assert [(m.job_id, m.status.code) for m in got] == [(capsule_job, 14)], got
    assert code == grpc.StatusCode.UNAVAILABLE
    late, late_code = await asyncio.wait_for(_drain(session.watch(include_retained=True)), 10)
    assert sorted(m.job_id for m in late) == sorted([rpc_job, capsule_job])
    assert late_code == grpc.StatusCode.UNAVAILABLE
    fresh, fresh_code = await asyncio.wait_for(_drain(session.watch()), 10)
    assert (fresh, fresh_code) == ([], grpc.StatusCode.UNAVAILABLE)


async def failed_takes_no_jobs(ctx: Ctx) -> None:
    """DP-4-4."""
    session = await ctx.open()
    src = await session.region(4096)
    volume = await ctx.volume(stubs=session.stubs)
    await _fail(session)
    spec = job_pb2.JobSpec(crc32c=job_pb2.Crc32cJob(source=session.ref(src)))
    precondition = grpc.StatusCode.FAILED_PRECONDITION
    assert await code_of(session.submit_rpc(spec)) == precondition
    assert await code_of(session.attach(volume)) == precondition
    assert await code_of(session.key(os.urandom(32))) == precondition


async def close_failed(ctx: Ctx) -> None:
    """DP-4-5."""
    session = await ctx.open()
    await _fail(session)
    await session.stubs.sessions.CloseSession(
        session_pb2.CloseSessionRequest(name=session.name, request_id=rid())
    )
    assert await code_of(session.get()) == grpc.StatusCode.NOT_FOUND


# ---------------------------------------------------------------- 5


async def no_new_work_while_draining(ctx: Ctx) -> None:
    """DP-5-1."""
    seen = await shutdown_scenario(ctx)
    assert (seen.submit.state, seen.submit.status) == (St.FAILED, 14), seen.submit
    assert seen.submit_rpc == grpc.StatusCode.UNAVAILABLE
    assert seen.open_session == grpc.StatusCode.UNAVAILABLE
    assert seen.exit_code == 0


async def open_jobs_may_finish(ctx: Ctx) -> None:
    """DP-5-2."""
    seen = await shutdown_scenario(ctx)
    assert seen.finishing.state == St.SUCCEEDED, seen.finishing
    assert seen.finishing_at < GRACE


async def then_cancelled(ctx: Ctx) -> None:
    """DP-5-3."""
    seen = await shutdown_scenario(ctx)
    long = seen.long
    assert (long.state, long.status, long.message) == (St.CANCELLED, 1, "agent shutting down"), long
    assert GRACE - 0.5 <= seen.long_at <= GRACE + PROMPT, seen.long_at
    assert [(state, code) for _, state, code in seen.rpc_long] == [(job_pb2.JOB_STATE_CANCELLED, 1)]
    assert seen.lease == grpc.StatusCode.OK
    assert seen.eof in (None, True)


# ---------------------------------------------------------------- the SDK's lease


async def sdk_holds_its_lease(ctx: Ctx) -> None:
    """DP-1.4-2 (short profile: unwatched sessions close after 1 s)."""
    async with host_client.Client(ctx.agent("short").address) as client:
        session = await client.open_session(transport=ctx.transport, rdma_device=ctx.device)
        async with session:
            await asyncio.sleep(3 * TIMERS["first_watch"])
            src = await session.alloc(4096, readable=True)
            src.view[:] = os.urandom(4096)
            dst = await session.alloc(4096, writable=True)
            await session.copy(src, dst)
            assert bytes(dst.view) == bytes(src.view)
            assert not session.failed


_ = wire

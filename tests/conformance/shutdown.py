"""Agent shutdown (docs/data-plane.md section 5), seen once per transport.

The main agent (grace_period 4 s) gets SIGTERM, after every other row, while a session
has three jobs open: one that finishes in about 2 s (within the grace period), one
that would take half a minute, and a SubmitJob job as long. During the drain the
scenario tries new work of every kind. Several rows of the table check what it saw.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dpu_wire.v1 import job_pb2
from tests.conformance import wire
from tests.conformance.harness import WAIT, Ctx, Stubs, code_of
from tests.conformance.rawtcp import READ, WRITE, RawTcpHost


@dataclasses.dataclass
class Seen:
    """What the scenario observed (times in seconds since the drain was seen to start)."""

    open_session: grpc.StatusCode
    submit: wire.Completion  # a good COPY sent during the drain
    submit_bad_span: wire.Completion  # one naming an unknown rkey: draining is checked first
    submit_rpc: grpc.StatusCode
    finishing: wire.Completion  # open at the start, done within the grace period
    finishing_at: float
    long: wire.Completion  # open at the start, still running when the grace period ends
    long_at: float
    rpc_long: list[tuple[int, int, int]]  # (job id, state, code) the lease stream got
    lease: grpc.StatusCode  # how the lease stream ended
    eof: bool | None  # tcp: the agent closed the connection
    exit_code: int


async def _draining(stubs: Stubs) -> float:
    health = health_pb2_grpc.HealthStub(stubs.channel)
    for _ in range(500):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=WAIT)
        if reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
            await asyncio.sleep(0.1)  # the session manager drains right behind the health flag
            return time.monotonic()
        await asyncio.sleep(0.01)
    raise AssertionError("the agent never reported NOT_SERVING after SIGTERM")


async def shutdown_scenario(ctx: Ctx) -> Seen:
    """Run it (once per agent set) and return what it saw."""
    memo = ctx.agents.memo
    if "shutdown" not in memo:
        memo["shutdown"] = await _run(ctx)
    seen = memo["shutdown"]
    assert isinstance(seen, Seen)
    return seen


async def _run(ctx: Ctx) -> Seen:
    agent = ctx.agents.take("main")  # the rows that look at this run last
    try:
        stubs = ctx.stubs(address=agent.address)
        session = await ctx.open(stubs=stubs)
        src = await session.region(4096, READ, fill=b"\x11" * 4096)
        dst = await session.region(4096, WRITE)
        rpc_long = await session.slow_rpc(30)
        long = await session.slow_write(30)
        finishing = await session.slow_write(3)  # ~2 s: its 2nd and 3rd chunk wait a second each
        for job in (rpc_long, long, finishing):  # admitted before the drain starts
            await session.running(job)
        agent.proc.send_signal(signal.SIGTERM)
        started = await _draining(stubs)
        submit = await session.run(wire.Kind.COPY, src.span(), dst.span())
        bad = await session.run(
            wire.Kind.COPY, wire.Span(src.addr, 4096, src.rkey ^ 0x5A5A), dst.span()
        )
        spec = job_pb2.JobSpec(
            copy=job_pb2.CopyJob(source=session.ref(src), destination=session.ref(dst))
        )
        submit_rpc = await code_of(session.submit_rpc(spec))
        other = ctx.host()
        other.listen()
        open_session = await code_of(stubs.sessions.OpenSession(ctx.request(other), timeout=10))
        done = await session.completion_for(finishing, timeout=30)
        finishing_at = time.monotonic() - started
        ended = await session.completion_for(long, timeout=30)
        long_at = time.monotonic() - started
        lease = [(m.job_id, m.state, m.status.code) async for m in session.lease]
        lease_code = await session.lease.code()
        eof = None
        if isinstance(session.host, RawTcpHost):
            await asyncio.wait_for(session.host.eof.wait(), 10)
            eof = session.host.eof.is_set()
        code = await asyncio.to_thread(agent.proc.wait, 30)
        return Seen(
            open_session, submit, bad, submit_rpc, done, finishing_at, ended, long_at,
            [(job, state, c) for job, state, c in lease if job == rpc_long], lease_code, eof, code,
        )  # fmt: skip
    finally:
        if agent.proc.poll() is None:
            agent.proc.kill()

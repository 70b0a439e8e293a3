"""A flood of huge AdvertiseRegions requests must not hold the control plane's event loop.

Issue 14: four parallel 3 MB requests of 55,000 regions each pushed other clients'
GetAgentInfo p50 to 0.8-1.2 s (idle p99 6.5 ms). Here four connections send such
requests in a loop (serialized once, so this process spends nothing on them) of the
issue's 55,000 regions (3 MB: over the server's request size limit), 15,000 regions
(860 KB: over AdvertiseRegions' own limit, refused before it is parsed) and 5,500
regions (310 KB: parsed, then refused by its count) while a second client times
GetAgentInfo; its latency under the flood is compared with its
idle latency measured in the same run. The bound asserted is generous (the issue's
bar is p99 within 5x the idle p99; the figures are printed for the report), so the
test says "not blocked", not "fast".
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time

import grpc
import pytest

import host_client
from dpu_agent.dataplane.regions import MAX_REGIONS_PER_SESSION
from dpu_wire.v1 import agent_pb2, agent_pb2_grpc, session_pb2
from tests.integration.conftest import start_agent

pytestmark = pytest.mark.asyncio
ATTACKERS = 4
REGIONS = (55_000, 15_000, 5_500)  # each attacker sends one kind (module docstring)
SAMPLES = 300
BUDGET = 30.0  # seconds of sampling under the flood at most (main took 1.2 s a call)
ADVERTISE = "/dpu.v1.SessionService/AdvertiseRegions"
LOCAL_POOL = (("grpc.use_local_subchannel_pool", 1),)  # a connection of its own


def flood_request(session: str, count: int) -> bytes:
    regions = [
        session_pb2.MemoryRegion(
            name=f"{session}/regions/r{index}",
            addr=0x1000_0000 + index * 4096,
            length=4096,
            rkey=index + 1,
            access=[session_pb2.REGION_ACCESS_REMOTE_READ],
        )
        for index in range(count)
    ]
    message = session_pb2.AdvertiseRegionsRequest(session=session, regions=regions)
    return message.SerializeToString()


async def latencies(stub: agent_pb2_grpc.AgentServiceAsyncStub, budget: float = 600) -> list[float]:
    """SAMPLES sequential GetAgentInfo calls (fewer if `budget` s run out), in seconds each."""
    taken: list[float] = []
    deadline = time.monotonic() + budget
    while len(taken) < SAMPLES and (len(taken) < 20 or time.monotonic() < deadline):
        start = time.perf_counter()
        await stub.GetAgentInfo(agent_pb2.GetAgentInfoRequest(), timeout=30)
        taken.append(time.perf_counter() - start)
    return taken


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


async def test_a_region_flood_does_not_block_other_clients(tmp_path):
    agent = start_agent(tmp_path, env={"DPU_AGENT_TRANSPORTS": "tcp"})
    channels = []
    try:
        async with host_client.Client(agent.address) as owner:
            session = await owner.open_session(transport="tcp")
            payloads = [flood_request(session.name, count) for count in REGIONS]
            assert len(payloads[0]) > 3_000_000  # over gRPC's 1 MiB
            assert 320 << 10 < len(payloads[1]) < 1 << 20  # over AdvertiseRegions' 320 KiB
            assert len(payloads[2]) <= 320 << 10  # parsed
            probe = grpc.aio.insecure_channel(agent.address, options=LOCAL_POOL)
            channels.append(probe)
            stub: agent_pb2_grpc.AgentServiceAsyncStub = agent_pb2_grpc.AgentServiceStub(probe)
            await latencies(stub)  # warm up
            idle = await latencies(stub)

            answers: list[grpc.StatusCode] = []

            async def attack(channel: grpc.aio.Channel, payload: bytes) -> None:
                call = channel.unary_unary(ADVERTISE, None, None)  # bytes in, bytes out
                while True:
                    try:
                        await call(payload, timeout=60)
                        answers.append(grpc.StatusCode.OK)
                    except grpc.aio.AioRpcError as exc:
                        answers.append(exc.code())

            attackers = [
                grpc.aio.insecure_channel(agent.address, options=LOCAL_POOL)
                for _ in range(ATTACKERS)
            ]
            channels += attackers
            tasks = [
                asyncio.create_task(attack(c, payloads[i % len(payloads)]))
                for i, c in enumerate(attackers)
            ]
            try:
                async with asyncio.timeout(120):
                    while len(answers) < ATTACKERS:  # noqa: ASYNC110 - every attacker is in
                        await asyncio.sleep(0.01)
                loaded = await latencies(stub, BUDGET)
                rounds = len(answers)
            finally:
                for task in tasks:
                    task.cancel()
                for task in tasks:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            # every flood request was refused, and the session holds none of it
            assert grpc.StatusCode.OK not in answers
            got = await owner.get_session(session.name)
            assert got.counters.regions <= MAX_REGIONS_PER_SESSION
            await session.close()
        figures: dict[str, float] = {
            "idle_p50_ms": p(idle, 0.5) * 1e3,
            "idle_p99_ms": p(idle, 0.99) * 1e3,
            "flood_p50_ms": p(loaded, 0.5) * 1e3,
            "flood_p99_ms": p(loaded, 0.99) * 1e3,
            "flood_requests_answered": rounds,
        }
        codes = sorted({c.name for c in answers})
        print(f"region flood: {figures} codes {codes}")  # noqa: T201 - the figures for the report
        # generous bounds from this run's own idle figure (the bar: p99 within 5x)
        # (before the fix: p50 609 ms, 430x the idle p99; after: 0.5-4x on a shared 2-core box)
        assert figures["flood_p50_ms"] <= 10 * figures["idle_p99_ms"], figures
        assert figures["flood_p99_ms"] <= 40 * figures["idle_p99_ms"], figures
    finally:
        for channel in channels:
            await channel.close(None)
        assert agent.terminate() == 0, agent.log_path.read_text()

"""SIGTERM drains in-flight RPCs, refuses new ones, and the agent exits 0."""

import asyncio
import signal
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.integration.conftest import start_agent

SLOW_AGENT = (sys.executable, str(Path(__file__).with_name("slow_agent.py")))

pytestmark = pytest.mark.asyncio


async def test_sigterm_lets_in_flight_calls_finish(tmp_path):
    agent = start_agent(tmp_path, program=SLOW_AGENT, env={"DPU_AGENT_GRACE_PERIOD": "20"})
    async with grpc.aio.insecure_channel(agent.address) as channel:
        sleep = channel.unary_unary("/test.Slow/Sleep", None, None)
        in_flight = asyncio.ensure_future(sleep(b"2", timeout=30))
        await asyncio.sleep(0.5)
        agent.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        health = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert await in_flight == b"done"
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert agent.proc.wait(30) == 0
    messages = [e.get("msg") for e in agent.log_entries()]
    assert messages.index("draining") < messages.index("stopped")


async def test_grace_period_bounds_the_drain(tmp_path):
    agent = start_agent(tmp_path, program=SLOW_AGENT, env={"DPU_AGENT_GRACE_PERIOD": "1"})
    async with grpc.aio.insecure_channel(agent.address) as channel:
        sleep = channel.unary_unary("/test.Slow/Sleep", None, None)
        in_flight = asyncio.ensure_future(sleep(b"60", timeout=90))
        await asyncio.sleep(0.5)
        agent.proc.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.aio.AioRpcError) as cut:
            await in_flight
        exit_code = await asyncio.to_thread(agent.proc.wait, 30)
    assert cut.value.code() in {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
    assert exit_code == 0  # and the 60 s call did not complete: the grace period cut it

"""Control-plane call rate: GetAgentInfo through the SDK vs the raw generated stub.

Both run in the same process, against the same agent process, on one channel
each, sequentially (one call in flight), so the ratio is the SDK's overhead
(request ids, error mapping) over grpc.aio itself. Five interleaved rounds of each,
the best of each: single rounds of the same stub moved by 10-20 % on the 2-core
machine, and the best of three put the ratio anywhere in 0.78-1.08. Figure `GetAgentInfo calls/s`
(it was `GetAgentInfo sequential calls`).
"""

from __future__ import annotations

import time

import grpc

import host_client
from bench import common
from bench.common import Result, agent_process, arun, quick, write_results
from dpu_wire.v1 import agent_pb2, agent_pb2_grpc

CALLS = quick(2000, 200)
ROUNDS = quick(5, 1)


async def _sdk_rate(target: str) -> float:
    async with host_client.Client(target) as client:
        await client.agent_info()
        start = time.perf_counter()
        for _ in range(CALLS):
            await client.agent_info()
        return CALLS / (time.perf_counter() - start)


async def _raw_rate(target: str) -> float:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        request = agent_pb2.GetAgentInfoRequest()
        await stub.GetAgentInfo(request)
        start = time.perf_counter()
        for _ in range(CALLS):
            await stub.GetAgentInfo(request)
        return CALLS / (time.perf_counter() - start)


async def _measure(target: str) -> tuple[float, float]:
    ours, ref = [], []
    for _ in range(ROUNDS):  # interleaved, best of ROUNDS each
        ref.append(await _raw_rate(target))
        ours.append(await _sdk_rate(target))
    return max(ours), max(ref)


def main() -> list[Result]:
    """Run the benchmark and write bench/results/grpc_unary.json."""
    with agent_process() as target:
        ours, ref = arun(_measure(target))
    results = [
        Result("GetAgentInfo calls/s", ours, ref, "calls/s", "raw grpc.aio stub"),
    ]
    write_results("grpc_unary", results)
    return results


if __name__ == "__main__":
    common.command_line(__doc__)
    main()

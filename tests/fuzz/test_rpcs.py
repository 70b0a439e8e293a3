"""Fuzzed requests to every RPC of every dpu.v1 service, over real gRPC.

For each RPC (found from the descriptors) hypothesis draws batches of requests:
generated messages, most of them naming real objects, some damaged on the wire.
Each batch is sent concurrently. Every call must end without INTERNAL or UNKNOWN
and without hanging, and the agent process must stay up.
"""

from __future__ import annotations

from typing import Final

import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

from tests.fuzz import rpcs
from tests.fuzz.conftest import check_alive
from tests.fuzz.proto_strategies import Hints, MessageStrategies, wire_bytes
from tests.fuzz.stats import LARGE_REPRS_OK, PROFILE, STATS
from tests.fuzz.templates import templates
from tests.fuzz.world import request_ids, safe_tcp_endpoints

pytestmark = LARGE_REPRS_OK

RPCS: Final = rpcs.all_rpcs()
EXAMPLES_PER_RPC: Final = 50
BATCH: Final = 4
RESTORE_EVERY: Final = 10


@pytest.fixture(scope="module")
def strategies(world) -> MessageStrategies:
    hints = Hints(
        strings=world.strings_for,
        overrides={
            "dpu.v1.TcpEndpoint": safe_tcp_endpoints(world.sink, world.agent_port),
        },
        templates=templates(world),
    )
    return MessageStrategies(hints)


def test_every_service_is_found():
    services = {rpc.service for rpc in RPCS}
    assert {
        "dpu.v1.AgentService",
        "dpu.v1.SessionService",
        "dpu.v1.JobService",
        "dpu.v1.StorageService",
        "dpu.v1.NetworkService",
        "dpu.v1.VirtualizationService",
    } <= services
    assert any(rpc.streaming for rpc in RPCS)


@pytest.mark.parametrize("rpc", RPCS, ids=str)
def test_fuzzed_requests(rpc, fuzz_loop, fuzz_agent, channel, world, strategies):
    requests = wire_bytes(rpc.request, strategies.message(rpc.request))
    batches = st.lists(st.tuples(requests, request_ids()), min_size=BATCH, max_size=BATCH)
    fuzz_loop.run(world.restore())
    sent = 0
    examples = 0

    @seed(STATS.seed)
    @settings(PROFILE, max_examples=EXAMPLES_PER_RPC)
    @given(batches)
    def run(batch):
        nonlocal sent, examples
        examples += 1
        if examples % RESTORE_EVERY == 0:
            fuzz_loop.run(world.restore())
        outcomes = fuzz_loop.run(rpcs.call_all(channel, rpc, batch), timeout=rpcs.HANG_S * 4)
        sent += len(batch)
        for outcome in outcomes:
            STATS.count("rpc", str(rpc), "open" if outcome.stream_open else outcome.code.name)
        check_alive(fuzz_agent)
        failures = [(data, o.failure) for (data, _), o in zip(batch, outcomes, strict=True)]
        failures = [(data, why) for data, why in failures if why is not None]
        assert not failures, f"{rpc}: {failures[0][1]} for request bytes {failures[0][0]!r}"

    run()
    assert sent >= EXAMPLES_PER_RPC * BATCH

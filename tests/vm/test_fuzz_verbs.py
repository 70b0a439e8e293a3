"""The verbs receive path fuzzed in the test VM: random capsules over an RC queue pair.

The capsule strategies of the host's fuzz (tests/fuzz/capsules.py: well-formed
capsules with one field wrong, random and damaged bytes, all at most 256 bytes) go out
as SENDs on a real verbs session to an agent on rxe0; each must get exactly the answer
the spec promises (a COMPLETION with the right job id, or none for a CANCEL), never
INTERNAL, and the session must survive and run good jobs afterwards. Then the agent
must be back where it was: no session or job slot held, resident memory and threads
about where they were after the warm-up, another client's GetAgentInfo p99 near its
idle figure (printed). Fewer cases than on the host: Python is slower in the VM.

Reproduce with the seed the failure message names: `DPU_FUZZ_SEED=<seed>`.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Final

import crc32c
import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

import host_client
from tests.fuzz import capsules
from tests.fuzz.latency import measure, percentile
from tests.fuzz.stats import PROFILE, STATS
from tests.integration.conftest import AgentProcess, start_agent

pytestmark = [pytest.mark.rdma]

EXAMPLES: Final = 25  # per strategy, of BATCH capsules each
BATCH: Final = 6
BUFFER: Final = 64 * 1024
SAMPLES: Final = 300
RSS_GROWTH_MAX: Final = 64 << 20
THREADS_GROWTH_MAX: Final = 8
AFTER_P99_MAX: Final = 10.0


@pytest.fixture(scope="module")
def fuzz_agent(rdma_port, tmp_path_factory):
    env = {
        "DPU_AGENT_TRANSPORTS": "verbs",
        "DPU_AGENT_RDMA_DEVICE": rdma_port.device,
        "DPU_AGENT_STORAGE_BACKEND": "memory",
        "DPU_AGENT_CHUNK_SIZE": "65536",
    }
    agent = start_agent(tmp_path_factory.mktemp("verbs-fuzz"), env=env)
    yield agent
    alive = agent.proc.poll() is None
    code = agent.terminate()
    assert alive, agent.log_path.read_text()[-4000:]
    assert code == 0, agent.log_path.read_text()[-4000:]


def status(pid: int) -> dict[str, int]:
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == "VmRSS":
            found["rss"] = int(value.split()[0]) * 1024
        elif key == "Threads":
            found["threads"] = int(value)
    return found


async def _open(
    client: host_client.Client, device: str
) -> tuple[host_client.Session, capsules.Target, list[host_client.Buffer]]:
    session = await client.open_session(transport="verbs", rdma_device=device, queue_depth=64)
    buffers = [
        await session.alloc(BUFFER, readable=True),
        await session.alloc(BUFFER, writable=True),
        await session.alloc(BUFFER, readable=True, writable=True),
    ]
    volumes = []
    for index in range(2):
        name = f"vf-vol-{index}-{os.getpid()}"
        await client.create_volume(name, 1 << 20)
        volumes.append(await session.attach(f"volumes/{name}"))
    key = await session.register_key(os.urandom(32))
    src, dst, both = (b.ref().span() for b in buffers)
    target = capsules.Target(
        readable=(src, both), writable=(dst, both), volumes=tuple(volumes), keys=(key,)
    )
    return session, target, buffers


async def _good_jobs(session: host_client.Session, buffers: list[host_client.Buffer]) -> None:
    src, dst, _ = buffers
    data = os.urandom(BUFFER)
    src.view[:] = data
    await session.copy(src, dst)
    assert bytes(dst.view) == data
    assert await session.crc32c(src) == crc32c.crc32c(data)


def test_random_capsules_over_verbs(fuzz_agent: AgentProcess, host_port):
    loop = asyncio.new_event_loop()
    try:
        _run(loop, fuzz_agent, host_port.device)
    finally:
        loop.close()


def _run(loop: asyncio.AbstractEventLoop, agent: AgentProcess, device: str) -> None:
    client = host_client.Client(agent.address, timeout=60)
    loop.run_until_complete(client.__aenter__())
    session, target, buffers = loop.run_until_complete(_open(client, device))
    for _ in range(5):  # warm-up: pools and caches at their working size
        loop.run_until_complete(_good_jobs(session, buffers))
    before = status(agent.proc.pid)
    idle = measure(agent.address, SAMPLES)
    sent = 0

    def exchange(batch: list[bytes]) -> None:
        nonlocal sent
        for capsule_round in capsules.rounds(batch):
            answers = loop.run_until_complete(
                asyncio.wait_for(capsules.exchange(session, capsule_round), capsules.HANG_S * 6)
            )
            sent += len(capsule_round)
            for data, done in zip(capsule_round, answers, strict=True):
                why = capsules.verdict(data, done)
                assert why is None, f"{why} for capsule {data.hex()} (DPU_FUZZ_SEED={STATS.seed})"
        assert agent.proc.poll() is None, "the agent died"
        assert not session.failed, f"{session.error} (DPU_FUZZ_SEED={STATS.seed})"
        assert session.protocol_errors == 0

    for strategy in (capsules.structured(target), capsules.damaged(target)):

        @seed(STATS.seed)
        @settings(PROFILE, max_examples=EXAMPLES)
        @given(st.lists(strategy, min_size=BATCH, max_size=BATCH))
        def run(batch: list[bytes]) -> None:
            exchange(batch)

        run()
    loop.run_until_complete(_good_jobs(session, buffers))
    loop.run_until_complete(session.close())
    metrics = agent.metrics()
    after = measure(agent.address, SAMPLES)
    now = status(agent.proc.pid)
    loop.run_until_complete(client.__aexit__(None, None, None))
    idle_p99, after_p99 = percentile(idle, 0.99), percentile(after, 0.99)
    figures = {
        "capsules": sent,
        "rss_growth_mib": (now["rss"] - before["rss"]) / (1 << 20),
        "threads": (before["threads"], now["threads"]),
        "idle_p99_ms": idle_p99 * 1e3,
        "after_p99_ms": after_p99 * 1e3,
        "seed": STATS.seed,
    }
    print(f"verbs capsule fuzz: {figures}")  # noqa: T201 - the figures for the log
    assert sent >= 2 * EXAMPLES * BATCH, figures
    assert metrics.get("dpu_agent_job_slots", 0.0) == 0, metrics
    assert metrics.get('dpu_agent_sessions_open{transport="verbs"}', 0.0) == 0, metrics
    assert now["rss"] - before["rss"] <= RSS_GROWTH_MAX, figures
    assert now["threads"] - before["threads"] <= THREADS_GROWTH_MAX, figures
    assert after_p99 <= AFTER_P99_MAX * idle_p99, figures

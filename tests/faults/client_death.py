"""The host program SIGKILLed with sessions open (tcp and verbs suites).

A separate process (`held_session_client`) opens `BUSY` sessions with registered
regions, an attached volume and a full queue of slow copies, plus one idle session
with regions only, and is then killed with SIGKILL. Within a bounded wait the agent
must have closed and forgotten every one of them: no session listed, the
open-session, in-flight and slot gauges back to 0, each session counted as closed
"orphaned" (the host is gone: nobody watched it for `orphan_timeout`, as with an idle
verbs session whose data plane cannot tell, or the host's end of the tcp link
closed) or "failed" (its data plane broke otherwise: a send to the dead host failed,
an RDMA operation found no responder), and its capacity (`max_sessions`) free for
new sessions, which work.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import crc32c
import pytest

import host_client
from dpu_wire.v1 import session_pb2
from tests.faults import held_session_client
from tests.faults.common import metric, scrape, session_names, until
from tests.integration.conftest import start_agent
from tests.integration.mqtt_broker import free_port

REPO = Path(__file__).resolve().parents[2]
BUSY = 2
ORPHAN_TIMEOUT = 2.0
ACTIVE = session_pb2.SESSION_STATE_ACTIVE


async def agent_frees_a_killed_hosts_sessions(
    tmp_path: Path, transport: str, env: dict[str, str], device: str | None = None
) -> dict[str, float]:
    """Run the scenario (module doc); return how many sessions closed, by reason."""
    metrics_address = f"127.0.0.1:{free_port()}"
    env = {
        **env,
        "DPU_AGENT_ORPHAN_TIMEOUT": str(ORPHAN_TIMEOUT),
        "DPU_AGENT_CHUNK_SIZE": "4096",  # slow copies, one at a time in each session:
        "DPU_AGENT_STAGING_BUFFERS": "1",  # still running at the kill
        "DPU_AGENT_MAX_SESSIONS": str(BUSY + 1),
        "DPU_AGENT_METRICS_LISTEN": metrics_address,
    }
    agent = start_agent(tmp_path, env=env)
    command = [sys.executable, "-m", held_session_client.__name__, agent.address, transport]
    command += [str(BUSY), *([device] if device else [])]
    host = subprocess.Popen(  # noqa: ASYNC220 - starting it is quick
        command, stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert host.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(host.stdout.readline), 120)
        assert line, f"the host program exited with {host.poll()} before it was ready"
        held = json.loads(line)
        names = {*held["busy"], held["idle"]}
        async with host_client.Client(agent.address, timeout=30) as client:
            before = await _check_held(client, transport, device, held, metrics_address)
            host.send_signal(signal.SIGKILL)
            host.wait(30)

            async def forgotten() -> bool:
                return not await session_names(client)

            await until(forgotten, "the agent to forget the killed host's sessions", 60)
            after = scrape(metrics_address)
            for gauge in ("sessions_open", "jobs_in_flight", "job_slots", "dataplane_links"):
                assert metric(after, f"dpu_agent_{gauge}") == 0, gauge
            closed = {
                reason: metric(after, "dpu_agent_sessions_closed_total", reason=reason)
                - metric(before, "dpu_agent_sessions_closed_total", reason=reason)
                for reason in ("orphaned", "failed", "closed")
            }
            assert closed["orphaned"] + closed["failed"] == len(names), closed
            await _capacity_is_free(client, transport, device)
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()
        if host.stdout is not None:
            host.stdout.close()
        assert agent.terminate() == 0, agent.log_path.read_text()
    print(f"\nsessions closed after the host was killed, by reason: {closed}")  # noqa: T201
    return closed


async def _check_held(
    client: host_client.Client,
    transport: str,
    device: str | None,
    held: dict[str, object],
    metrics_address: str,
) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """What the agent holds for the host before the kill; return the metrics then."""
    busy = held["busy"]
    assert isinstance(busy, list)
    assert await session_names(client) == {*busy, held["idle"]}
    for name in [*busy, held["idle"]]:
        session = await client.get_session(name)
        assert session.state == ACTIVE, session
        assert session.counters.regions == held_session_client.REGIONS, session
    for name in busy:
        running = [j for j in await client.list_jobs(name) if not j.HasField("completion")]
        assert running, f"{name}: its jobs finished before the kill; make them slower"
    with pytest.raises(host_client.ResourceExhaustedError):  # the agent is full
        await client.open_session(transport=transport, rdma_device=device)
    samples = scrape(metrics_address)
    assert metric(samples, "dpu_agent_sessions_open") == len(busy) + 1
    assert metric(samples, "dpu_agent_jobs_in_flight") > 0
    assert metric(samples, "dpu_agent_job_slots") == (len(busy) + 1) * (
        held_session_client.QUEUE_DEPTH
    )
    return samples


async def _capacity_is_free(client: host_client.Client, transport: str, device: str | None) -> None:
    """As many new sessions as the agent takes, each running a job."""
    sessions = [
        await client.open_session(transport=transport, rdma_device=device) for _ in range(BUSY + 1)
    ]
    try:
        for session in sessions:
            buffer = await session.alloc(4096, readable=True)
            buffer.view[:] = b"z" * 4096
            assert await session.crc32c(buffer) == crc32c.crc32c(b"z" * 4096)
    finally:
        for session in sessions:
            await session.close()

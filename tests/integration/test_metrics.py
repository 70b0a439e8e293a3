"""The agent's /metrics endpoint, scraped over HTTP while real jobs run over tcp.

The agent is a separate process (`start_agent`, metrics on a free loopback port);
the counts it reports must match the jobs this test ran, kind by kind.
"""

import asyncio
import os
from pathlib import Path

import pytest

import host_client
from dpu_agent.metrics_http import READ_TIMEOUT
from tests.integration.conftest import start_agent

pytestmark = pytest.mark.asyncio

SIZE = 64 << 10
COPIES = 20
CRCS = 10
DEPTH = 8


async def scrape(agent):
    return await asyncio.to_thread(agent.metrics)


async def test_counts_match_the_jobs_run(tmp_path):
    agent = start_agent(tmp_path)
    try:
        before = await scrape(agent)
        assert before['dpu_agent_sessions_open{transport="tcp"}'] == 0
        assert before['dpu_agent_jobs_total{kind="copy",status="OK"}'] == 0
        async with host_client.Client(agent.address) as client:
            session = await client.open_session(transport="tcp", queue_depth=DEPTH)
            src = await session.alloc(SIZE, readable=True)
            dst = await session.alloc(SIZE, writable=True)
            src.view[:] = os.urandom(SIZE)

            during = await scrape(agent)
            assert during['dpu_agent_sessions_open{transport="tcp"}'] == 1
            assert during['dpu_agent_sessions_opened_total{transport="tcp"}'] == 1
            assert during["dpu_agent_job_slots"] == DEPTH

            for _ in range(COPIES):
                await session.copy(src, dst)  # capsules on the data plane
            for _ in range(CRCS):
                assert (await (await session.submit_rpc("crc32c", src))).ok  # SubmitJob
            failed = await (await session.submit_compute("encrypt", src, dst, parameter=999))
            assert failed.code == "INVALID_ARGUMENT"  # no key under handle 999

            await client.create_volume("vol-m", 1 << 20)
            await session.write_volume("volumes/vol-m", 0, src)
            await session.read_volume("volumes/vol-m", 0, dst)
            assert dst.view == src.view

            after_jobs = await scrape(agent)
            await session.close()
            closed = await scrape(agent)
    finally:
        assert agent.terminate() == 0

    jobs = {k: v for k, v in after_jobs.items() if k.startswith("dpu_agent_jobs_total{")}
    assert {k: v for k, v in jobs.items() if v} == {
        'dpu_agent_jobs_total{kind="copy",status="OK"}': COPIES,
        'dpu_agent_jobs_total{kind="crc32c",status="OK"}': CRCS,
        'dpu_agent_jobs_total{kind="encrypt",status="INVALID_ARGUMENT"}': 1,
        'dpu_agent_jobs_total{kind="volume_write",status="OK"}': 1,
        'dpu_agent_jobs_total{kind="volume_read",status="OK"}': 1,
    }
    duration = "dpu_agent_job_duration_seconds_count"
    assert after_jobs[f'{duration}{{kind="copy"}}'] == COPIES
    assert after_jobs[f'{duration}{{kind="crc32c"}}'] == CRCS
    assert after_jobs[f'{duration}{{kind="encrypt"}}'] == 1

    # bytes the agent READ from host memory: copies, crc32c and the volume write read
    # the source; it WROTE the copies' and the volume read's destinations
    moved = "dpu_agent_dataplane_bytes_total"
    assert after_jobs[f'{moved}{{direction="read",transport="tcp"}}'] == (COPIES + CRCS + 1) * SIZE
    assert after_jobs[f'{moved}{{direction="written",transport="tcp"}}'] == (COPIES + 1) * SIZE
    assert after_jobs[f'{moved}{{direction="read",transport="verbs"}}'] == 0

    volume = 'volume="vol-m"'
    assert after_jobs[f'dpu_agent_volume_ops_total{{op="write",{volume}}}'] == 1
    assert after_jobs[f'dpu_agent_volume_bytes_total{{op="write",{volume}}}'] == SIZE
    assert after_jobs[f'dpu_agent_volume_ops_total{{op="read",{volume}}}'] == 1
    assert after_jobs[f'dpu_agent_volume_bytes_total{{op="read",{volume}}}'] == SIZE
    assert after_jobs["dpu_agent_jobs_in_flight"] == 0

    assert closed['dpu_agent_sessions_open{transport="tcp"}'] == 0
    assert closed["dpu_agent_job_slots"] == 0
    assert closed['dpu_agent_sessions_closed_total{reason="closed"}'] == 1
    assert closed['dpu_agent_sessions_closed_total{reason="orphaned"}'] == 0
    assert closed['dpu_agent_dataplane_errors_total{transport="tcp"}'] == 0
    assert "dpu_agent_mqtt_events_queued_total" not in closed  # MQTT is off


async def test_an_empty_listen_address_serves_no_metrics(tmp_path):
    agent = start_agent(tmp_path, env={"DPU_AGENT_METRICS_LISTEN": ""})
    try:
        with pytest.raises(RuntimeError, match="the agent serves no metrics"):
            agent.metrics_url()
        async with host_client.Client(agent.address) as client:
            assert await client.health() == "SERVING"
    finally:
        assert agent.terminate() == 0


async def test_a_busy_metrics_port_is_logged_and_the_agent_serves_anyway(tmp_path):
    first = start_agent(tmp_path)
    try:
        taken = first.metrics_url().split("/")[2]  # host:port
        second = start_agent(tmp_path, env={"DPU_AGENT_METRICS_LISTEN": taken})
        try:
            errors = [e for e in second.log_entries() if e.get("level") == "error"]
            assert [e["msg"] for e in errors] == ["metrics endpoint disabled: cannot listen"]
            assert errors[0]["listen"] == taken
            async with host_client.Client(second.address) as client:
                assert await client.health() == "SERVING"
        finally:
            assert second.terminate() == 0
    finally:
        assert first.terminate() == 0


HALF_SENT = 1000


def threads_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text(encoding="ascii").splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads: line")


async def closed_by_peer(reader: asyncio.StreamReader) -> bytes:
    """What the peer sent before it closed (a reset, as for unread input, counts as closed)."""
    try:
        return await reader.read()
    except ConnectionResetError:
        return b""


async def test_half_sent_requests_hold_no_threads_and_a_scrape_still_works(tmp_path):
    """1,000 connections that send half a request: no thread each, and each times out."""
    agent = start_agent(tmp_path)
    try:
        host, _, rest = agent.metrics_url().removeprefix("http://").partition(":")
        port = int(rest.partition("/")[0])
        await scrape(agent)  # the endpoint has served once
        before = threads_of(agent.proc.pid)
        held = []
        try:
            for _ in range(HALF_SENT):
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # no blank line: half
                held.append((reader, writer))
            await asyncio.sleep(0.5)
            during = threads_of(agent.proc.pid)
            assert during <= before + 2, (before, during)  # was one thread per connection
            samples = await scrape(agent)  # a scraper still gets its answer meanwhile
            assert any(key.startswith("dpu_agent_info{") for key in samples)
            # every half-sent connection is closed by the agent: crowded out by newer
            # ones, or at the end of the read timeout
            ends = await asyncio.wait_for(
                asyncio.gather(*(closed_by_peer(reader) for reader, _ in held)), READ_TIMEOUT + 10
            )
            assert ends == [b""] * HALF_SENT
        finally:
            for _, writer in held:
                writer.close()
        assert threads_of(agent.proc.pid) <= before + 2
        assert any(key.startswith("dpu_agent_info{") for key in await scrape(agent))
    finally:
        assert agent.terminate() == 0

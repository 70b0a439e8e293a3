"""The agent in its container, the SDK and dpuctl outside it (`make test-container`).

Real podman, the image `deploy/container/build.sh` built, host networking on loopback,
mTLS with certificates mounted read-only, the volume store in a mounted directory, a
real mosquitto beside it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import urllib.request
import zlib
from pathlib import Path

import pytest

import host_client
from tests.container.conftest import AGENT_UID

MiB = 1 << 20


def test_the_agent_runs_as_its_own_user_without_capabilities(container):
    status = container.exec("cat", "/proc/1/status")
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    assert fields["Uid"].split()[:2] == [str(AGENT_UID), str(AGENT_UID)]
    for cap in ("CapInh", "CapPrm", "CapEff", "CapAmb"):  # the Containerfile: none
        assert int(fields[cap].strip(), 16) == 0, f"{cap} {fields[cap].strip()}"
    assert container.exec("id", "-un").strip() == "dpu-agent"


@pytest.mark.asyncio
async def test_jobs_over_the_tcp_data_plane_and_their_events_on_mqtt(container, broker):
    tls = container.pki.client("acme")
    async with (
        host_client.EventSubscriber("127.0.0.1", broker.port) as events,
        host_client.Client(container.address, tls=tls) as client,
        await client.open_session(transport="tcp") as session,
    ):
        status = await events.agent_status("container-agent", wait=20)
        assert status is not None
        assert status.online
        async with events.completions(session=session.name) as stream:
            src = await session.alloc(64 << 10, readable=True)
            src.view[:] = os.urandom(64 << 10)
            jobs = [await session.submit_crc32c(src) for _ in range(20)]
            ids = set()
            for job in jobs:
                completion = await job
                assert completion.ok
                ids.add(job.job_id)
            seen = set()
            async with asyncio.timeout(30):
                async for event in stream:
                    seen.add(event.job_id)
                    if seen == ids:
                        break
        assert seen == ids


@pytest.mark.asyncio
async def test_a_volume_survives_a_container_restart(container):
    tls = container.pki.client("acme")
    data = os.urandom(2 * MiB)
    async with (
        host_client.Client(container.address, tls=tls) as client,
        await client.open_session(transport="tcp") as session,
    ):
        await client.create_volume("kept", 8 * MiB, crc32c=True)
        src = await session.alloc(len(data), readable=True)
        src.view[:] = data
        assert (await session.write_volume("volumes/kept", 4096, src)).ok
    assert (container.state / "volumes").is_dir()  # in the mounted directory

    container.restart()

    async with (
        host_client.Client(container.address, tls=tls) as client,
        await client.open_session(transport="tcp") as session,
    ):
        dst = await session.alloc(len(data), writable=True)
        assert (await session.read_volume("volumes/kept", 4096, dst)).ok
        assert zlib.crc32(dst.view) == zlib.crc32(data)
        assert bytes(dst.view) == data
    listed = await asyncio.to_thread(
        subprocess.run,
        [
            str(Path(sys.executable).parent / "dpuctl"),
            "--target",
            container.address,
            *container.pki.cli_args("acme"),
            "volume",
            "list",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert "kept" in listed.stdout


def test_metrics_are_served_on_the_hosts_loopback(container):
    url = f"http://127.0.0.1:{container.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    assert "dpu_agent_sessions_open" in text
    assert "dpu_agent_jobs_total" in text


def test_sigterm_drains_and_the_agent_exits_0(container):
    """Last in the module: stops the container."""
    result = container.stop_and_wait()
    assert result == 0, container.logs()
    messages = [entry.get("msg") for entry in container.log_entries()]
    assert "draining" in messages
    assert messages[-1] == "stopped"

"""`dpuctl volume` and `dpuctl events` as a user runs them, against real processes."""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import host_client
from tests.integration.conftest import start_agent
from tests.integration.mqtt_broker import mosquitto_broker  # noqa: F401 - fixture

BIN = Path(sys.executable).parent


def dpuctl(target, *args, timeout=120):
    return subprocess.run(
        [str(BIN / "dpuctl"), "--target", target, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_volume_lifecycle_and_file_round_trip(agent, tmp_path):
    made = dpuctl(agent.address, "volume", "create", "cli-vol", "--size", "8M", "--crc32c",
                  "--compression", "zstd", "--encryption", "aes-xts-256")  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert "volumes/cli-vol" in made.stdout
    assert "crc32c,zstd,aes_xts_256" in made.stdout
    source = tmp_path / "in.bin"
    data = os.urandom(3 * (1 << 20) + 1234)  # not a whole number of blocks
    source.write_bytes(data)
    put = dpuctl(agent.address, "volume", "put", "cli-vol", str(source))
    assert put.returncode == 0, put.stderr
    assert f"{len(data)} bytes" in put.stderr
    out = tmp_path / "out.bin"
    got = dpuctl(agent.address, "volume", "get", "cli-vol", "--output", str(out),
                 "--length", str(len(data) + 3562))  # fmt: skip
    assert got.returncode == 0, got.stderr
    back = out.read_bytes()
    assert back[: len(data)] == data
    assert back[len(data) :] == bytes(3562)  # the padded tail of the last block
    listing = dpuctl(agent.address, "volume", "list")
    assert "volumes/cli-vol" in listing.stdout
    grown = dpuctl(agent.address, "volume", "resize", "cli-vol", "--size", "16M")
    assert str(16 << 20) in grown.stdout
    too_big = dpuctl(agent.address, "volume", "put", "cli-vol", str(source), "--offset", "15M")
    assert too_big.returncode == 1
    assert "does not fit" in too_big.stderr
    gone = dpuctl(agent.address, "volume", "delete", "cli-vol")
    assert gone.returncode == 0, gone.stderr
    missing = dpuctl(agent.address, "volume", "get", "cli-vol")
    assert missing.returncode == 1
    assert missing.stderr.startswith("dpuctl: NOT_FOUND")


def test_bad_sizes_are_usage_errors(agent):
    bad = dpuctl(agent.address, "volume", "create", "x", "--size", "lots")
    assert bad.returncode == 2
    assert "not a size" in bad.stderr


@pytest.mark.asyncio
async def test_events_follow_prints_each_completion(mosquitto_broker, tmp_path):  # noqa: F811
    agent = start_agent(
        tmp_path,
        env={"DPU_AGENT_MQTT_ENABLED": "true", "DPU_AGENT_MQTT_PORT": str(mosquitto_broker.port)},
    )
    broker = f"127.0.0.1:{mosquitto_broker.port}"
    try:
        follower = await asyncio.create_subprocess_exec(
            str(BIN / "dpuctl"), "events", "--broker", broker, "--follow", "--count", "5",
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        await asyncio.sleep(1.0)  # let it subscribe (completions are not retained)
        async with (
            host_client.Client(agent.address) as client,
            await client.open_session(transport="tcp") as session,
        ):
            src = await session.alloc(4096, readable=True)
            for _ in range(5):
                await session.crc32c(src)
        out, _ = await asyncio.wait_for(follower.communicate(), 30)
        lines = [json.loads(line) for line in out.decode().splitlines()]
        assert len(lines) == 5
        assert {line["state"] for line in lines} == {"SUCCEEDED"}
        status = await asyncio.to_thread(dpuctl, agent.address, "events", "--broker", broker)
        assert '"state": "online"' in status.stdout
    finally:
        assert agent.terminate() == 0

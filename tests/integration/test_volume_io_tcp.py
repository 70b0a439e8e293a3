"""Volume I/O jobs through the agent over tcp: data services, errors, durability."""

import os
import signal

import pytest

import host_client
from tests.integration.conftest import start_agent
from tests.scenarios import volume_io

pytestmark = pytest.mark.asyncio

MiB = 1 << 20


async def test_every_data_service_combination_round_trips(agent):
    async with host_client.Client(agent.address) as client:
        checked = await volume_io.round_trips(client, "tcp", "combo")
    assert checked == len(volume_io.COMBINATIONS) * (2 * MiB + 4096 + 8192)


@pytest.mark.parametrize(
    ("offset", "length", "error", "fragment"),
    [
        (100, 4096, host_client.InvalidArgumentError, "multiple of the block size"),
        (0, 1000, host_client.InvalidArgumentError, "multiple of the block size"),
        (8 * MiB - 4096, 8192, host_client.InvalidArgumentError, "past the end"),
        (1 << 62, 4096, host_client.InvalidArgumentError, "past the end"),
    ],
)
async def test_bad_volume_io_is_refused_and_writes_nothing(agent, offset, length, error, fragment):
    async with (
        host_client.Client(agent.address) as client,
        await client.open_session(transport="tcp") as session,
    ):
        name = f"volumes/badio-{offset % 1000}-{length}"
        await client.create_volume(name.removeprefix("volumes/"), 8 * MiB, crc32c=True)
        src = await session.alloc(8192, readable=True)
        src.view[:] = b"\xab" * 8192
        with pytest.raises(error, match=fragment):
            await session.write_volume(name, offset, src[0:length])
        dst = await session.alloc(8 * MiB, writable=True)
        await session.read_volume(name, 0, dst)
        assert dst.view == bytes(8 * MiB), "a refused write changed the volume"


async def test_unknown_volume_and_unattached_handle(agent):
    async with (
        host_client.Client(agent.address) as client,
        await client.open_session(transport="tcp") as session,
    ):
        with pytest.raises(host_client.NotFoundError):
            await session.attach("volumes/nope")
        buf = await session.alloc(4096, readable=True)
        session._volumes["volumes/ghost"] = 999  # a handle the agent never gave
        with pytest.raises(host_client.InvalidArgumentError, match="handle 999"):
            await session.write_volume("volumes/ghost", 0, buf)


async def test_corrupted_block_is_detected_on_read(tmp_path):
    store = tmp_path / "volumes"
    agent = start_agent(tmp_path, env={"DPU_AGENT_STORAGE_DIR": str(store)})
    try:
        async with (
            host_client.Client(agent.address) as client,
            await client.open_session(transport="tcp") as session,
        ):
            await client.create_volume("rot-1", MiB, crc32c=True)
            src = await session.alloc(MiB, readable=True)
            src.view[:] = os.urandom(MiB)
            await session.write_volume("volumes/rot-1", 0, src, fua=True)
            files = [p for p in store.rglob("*") if p.is_file() and "rot-1" in p.name]
            assert files, list(store.rglob("*"))
            with files[0].open("r+b") as f:
                f.seek(5 * 4096 + 7)
                byte = f.read(1)
                f.seek(5 * 4096 + 7)
                f.write(bytes([byte[0] ^ 0xFF]))
            dst = await session.alloc(MiB, writable=True)
            with pytest.raises(host_client.DataLossError, match="CRC32C"):
                await session.read_volume("volumes/rot-1", 0, dst)
            await session.read_volume("volumes/rot-1", 0, dst[0 : 5 * 4096])  # the rest is fine
    finally:
        assert agent.terminate() == 0


async def test_acknowledged_writes_survive_sigkill_of_the_agent(tmp_path):
    env = {"DPU_AGENT_STORAGE_DIR": str(tmp_path / "volumes")}
    agent = start_agent(tmp_path, env=env)
    written = {}
    async with host_client.Client(agent.address) as client:
        await client.create_volume(
            "durable-1", 16 * MiB, crc32c=True, compression="lz4", encryption="aes-xts-256"
        )
        async with await client.open_session(transport="tcp") as session:
            src = await session.alloc(MiB, readable=True)
            for block in range(12):
                data = os.urandom(MiB)
                src.view[:] = data
                await session.write_volume("volumes/durable-1", block * MiB, src, fua=True)
                written[block] = data  # acknowledged, with FUA
            agent.proc.send_signal(signal.SIGKILL)
            agent.proc.wait(10)
    restarted = start_agent(tmp_path, env=env)
    try:
        async with (
            host_client.Client(restarted.address) as client,
            await client.open_session(transport="tcp") as session,
        ):
            dst = await session.alloc(MiB, writable=True)
            for block, data in written.items():
                await session.read_volume("volumes/durable-1", block * MiB, dst)
                assert dst.view == data, f"acknowledged block {block} lost"
            volume = await client.get_volume("volumes/durable-1")
            assert volume.data_services.crc32c
    finally:
        assert restarted.terminate() == 0

"""Volume faults, shared by the tcp (host) and verbs (VM) suites: a corrupted block on
disk, and the agent killed after acknowledging FUA writes."""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING

import pytest

import host_client
from tests.integration.conftest import start_agent

if TYPE_CHECKING:
    from pathlib import Path

MiB = 1 << 20


async def corrupted_block_is_detected(tmp_path: Path, transport: str, env: dict[str, str]) -> None:
    """Flip a byte in a volume file: the read fails with DATA_LOSS, the rest reads fine."""
    store = tmp_path / "volumes"
    agent = start_agent(tmp_path, env={**env, "DPU_AGENT_STORAGE_DIR": str(store)})
    try:
        async with (
            host_client.Client(agent.address) as client,
            await client.open_session(transport=transport) as session,
        ):
            await client.create_volume("rot-1", MiB, crc32c=True)
            src = await session.alloc(MiB, readable=True)
            src.view[:] = os.urandom(MiB)
            await session.write_volume("volumes/rot-1", 0, src, fua=True)
            pool = store / "pool"  # every block lives in the pool: find block 5 by its bytes
            raw = pool.read_bytes()
            at = raw.find(bytes(src.view[5 * 4096 : 6 * 4096]))
            assert at >= 0, "block 5 is not in the pool as written"
            with pool.open("r+b") as f:
                f.seek(at + 7)
                f.write(bytes([raw[at + 7] ^ 0xFF]))
            dst = await session.alloc(MiB, writable=True)
            with pytest.raises(host_client.DataLossError, match="CRC32C"):
                await session.read_volume("volumes/rot-1", 0, dst)
            await session.read_volume("volumes/rot-1", 0, dst[0 : 5 * 4096])  # the rest is fine
    finally:
        assert agent.terminate() == 0


async def acknowledged_writes_survive_sigkill(
    tmp_path: Path, transport: str, env: dict[str, str]
) -> None:
    """SIGKILL the agent after FUA-acknowledged writes; a restarted agent has every byte."""
    env = {**env, "DPU_AGENT_STORAGE_DIR": str(tmp_path / "volumes")}
    agent = start_agent(tmp_path, env=env)
    written = {}
    async with host_client.Client(agent.address) as client:
        await client.create_volume(
            "durable-1", 16 * MiB, crc32c=True, compression="lz4", encryption="aes-xts-256"
        )
        async with await client.open_session(transport=transport) as session:
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
            await client.open_session(transport=transport) as session,
        ):
            dst = await session.alloc(MiB, writable=True)
            for block, data in written.items():
                await session.read_volume("volumes/durable-1", block * MiB, dst)
                assert dst.view == data, f"acknowledged block {block} lost"
            volume = await client.get_volume("volumes/durable-1")
            assert volume.data_services.crc32c
    finally:
        assert restarted.terminate() == 0

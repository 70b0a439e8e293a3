"""Fault: the volume store fills up: its filesystem (a small tmpfs mounted for the test),
or the memory backend's capacity ([storage] memory_capacity).

Two thin volumes are created, together larger than the room; one is written in full,
the other 1 MiB at a time until the store is full. The write that finds no space
fails with RESOURCE_EXHAUSTED ("no space left ..."), by capsule and by SubmitJob;
every acknowledged byte still reads back (with its CRC32C checked by the agent), also
after the agent is restarted on the full store (file backend); deleting a volume gives
the space back and writes work again. The memory backend fails the same way, so a
tenant cannot write the agent out of memory (the kernel's OOM killer would take every
tenant down with it).
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

import host_client
from dpu_wire.v1 import job_pb2
from tests.faults.common import MiB, random_blocks
from tests.integration.conftest import start_agent

pytestmark = pytest.mark.asyncio

FS_BYTES = 24 * MiB
MEMORY_CAPACITY = FS_BYTES  # the memory backend's room: as much as the tmpfs
FIRST = "full-a"  # written in full, deleted at the end to make room
SECOND = "full-b"  # written until the disk is full
FIRST_BYTES = 12 * MiB
SECOND_BYTES = 16 * MiB


@pytest.fixture
def small_fs(tmp_path):
    """A FS_BYTES tmpfs at tmp_path/small, unmounted after the test."""
    mount = tmp_path / "small"
    mount.mkdir()
    command = ["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES},mode=0700", "tmpfs", str(mount)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        pytest.skip(
            f"cannot mount a {FS_BYTES >> 20} MiB tmpfs for the volume store (needs root or "
            f"CAP_SYS_ADMIN; the soft-RoCE VM runs as root): {result.stderr.strip()}"
        )
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def _write_spec(buffer: host_client.Buffer, volume: str, offset: int) -> job_pb2.JobSpec:
    spec = job_pb2.JobSpec()
    spec.volume_write.volume = volume
    spec.volume_write.offset = offset
    spec.volume_write.fua = True
    spec.volume_write.source.CopyFrom(buffer.ref().region_ref())
    return spec


async def _fill(
    session: host_client.Session,
    src: host_client.Buffer,
    volume: str,
    written: dict[tuple[str, int], bytes],
) -> None:
    """Write the volume 1 MiB at a time (FUA, by capsule), noting each acknowledged MiB."""
    for offset in range(0, SECOND_BYTES, MiB):
        src.view[:] = data = random_blocks(MiB)
        await session.write_volume(volume, offset, src, fua=True)
        written[volume, offset] = data


async def _read_back(session: host_client.Session, written: dict[tuple[str, int], bytes]) -> None:
    dst = await session.alloc(MiB, writable=True)
    for (volume, offset), data in written.items():
        await session.read_volume(volume, offset, dst)  # the agent checks each block's CRC
        assert dst.view == data, f"{volume} at {offset} changed"
    await session.free(dst)


async def _fill_until_full(
    client: host_client.Client,
    session: host_client.Session,
    written: dict[tuple[str, int], bytes],
) -> tuple[int, str]:
    """Create both volumes, write FIRST in full and SECOND until the store is full.

    Checks that the write that found no room failed by capsule and by SubmitJob and
    the session lives on; returns where SECOND's acknowledged data ends, and the error.
    """
    first, second = f"volumes/{FIRST}", f"volumes/{SECOND}"
    await client.create_volume(FIRST, FIRST_BYTES, crc32c=True, compression="lz4")
    await client.create_volume(SECOND, SECOND_BYTES, crc32c=True)
    src = await session.alloc(MiB, readable=True)
    for offset in range(0, FIRST_BYTES, MiB):
        src.view[:] = data = random_blocks(MiB)
        await session.write_volume(first, offset, src, fua=True)
        written[first, offset] = data
    with pytest.raises(host_client.ResourceExhaustedError, match="no space left") as full:
        await _fill(session, src, second, written)
    full_at = len([key for key in written if key[0] == second]) * MiB
    assert full_at < SECOND_BYTES, "the store never filled up"
    job = await session.submit_spec(_write_spec(src, second, full_at))
    with pytest.raises(host_client.ResourceExhaustedError, match="no space left"):
        (await job).raise_for_status()
    assert not session.failed, "a full store must fail the job, not the session"
    await session.free(src)
    return full_at, full.value.message


async def _make_room_and_finish(
    client: host_client.Client,
    session: host_client.Session,
    written: dict[tuple[str, int], bytes],
    full_at: int,
) -> None:
    """Delete FIRST (its space comes back), write the rest of SECOND, read all back."""
    first, second = f"volumes/{FIRST}", f"volumes/{SECOND}"
    await client.delete_volume(first)
    for key in [key for key in written if key[0] == first]:
        del written[key]
    src = await session.alloc(MiB, readable=True)
    for offset in range(full_at, SECOND_BYTES, MiB):
        src.view[:] = data = random_blocks(MiB)
        if offset % (2 * MiB):
            job = await session.submit_spec(_write_spec(src, second, offset))
            (await job).raise_for_status()
        else:
            await session.write_volume(second, offset, src, fua=True)
        written[second, offset] = data
    await _read_back(session, written)
    assert len(written) * MiB == SECOND_BYTES


async def test_a_full_disk_fails_writes_cleanly_and_recovers(small_fs, tmp_path):
    env = {"DPU_AGENT_STORAGE_DIR": str(small_fs / "store")}
    agent = start_agent(tmp_path, env=env)
    written: dict[tuple[str, int], bytes] = {}
    try:
        async with (
            host_client.Client(agent.address, timeout=30) as client,
            await client.open_session(transport="tcp") as session,
        ):
            full_at, message = await _fill_until_full(client, session, written)
            free_left = shutil.disk_usage(small_fs).free
            await _read_back(session, written)
        print(  # noqa: T201 - the numbers the report quotes
            f"\ndisk full after {len(written)} MiB acknowledged ({free_left} bytes free): {message}"
        )
        assert agent.terminate() == 0, agent.log_path.read_text()

        agent = start_agent(tmp_path, env=env)  # the full store opens again
        async with (
            host_client.Client(agent.address, timeout=30) as client,
            await client.open_session(transport="tcp") as session,
        ):
            names = {v.name for v in await client.list_volumes()}
            assert names == {f"volumes/{FIRST}", f"volumes/{SECOND}"}
            await _read_back(session, written)
            await _make_room_and_finish(client, session, written, full_at)
    finally:
        assert agent.terminate() == 0, agent.log_path.read_text()


async def test_the_memory_backend_fails_writes_past_its_capacity_as_a_full_disk(tmp_path):
    env = {
        "DPU_AGENT_STORAGE_BACKEND": "memory",
        "DPU_AGENT_STORAGE_MEMORY_CAPACITY": str(MEMORY_CAPACITY),
    }
    agent = start_agent(tmp_path, env=env)
    written: dict[tuple[str, int], bytes] = {}
    try:
        async with (
            host_client.Client(agent.address, timeout=30) as client,
            await client.open_session(transport="tcp") as session,
        ):
            full_at, message = await _fill_until_full(client, session, written)
            await _read_back(session, written)
            print(f"\nmemory store full after {len(written)} MiB acknowledged: {message}")  # noqa: T201
            await _make_room_and_finish(client, session, written, full_at)
    finally:
        assert agent.terminate() == 0, agent.log_path.read_text()

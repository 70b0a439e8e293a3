"""Fault: the volume store's filesystem fills up (a small tmpfs mounted for the test).

Two thin volumes are created on a `FS_BYTES` tmpfs; one is written in full, the other
1 MiB at a time until the filesystem is full. The write that finds no space fails
with RESOURCE_EXHAUSTED ("no space left ..."), by capsule and by SubmitJob; every
acknowledged byte still reads back (with its CRC32C checked by the agent), also
after the agent is restarted on the full store; deleting a volume gives the space
back and writes work again.
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


async def test_a_full_disk_fails_writes_cleanly_and_recovers(small_fs, tmp_path):
    env = {"DPU_AGENT_STORAGE_DIR": str(small_fs / "store")}
    agent = start_agent(tmp_path, env=env)
    written: dict[tuple[str, int], bytes] = {}
    first, second = f"volumes/{FIRST}", f"volumes/{SECOND}"
    try:
        async with (
            host_client.Client(agent.address, timeout=30) as client,
            await client.open_session(transport="tcp") as session,
        ):
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
            assert full_at < SECOND_BYTES, "the disk never filled up"
            job = await session.submit_spec(_write_spec(src, second, full_at))
            with pytest.raises(host_client.ResourceExhaustedError, match="no space left"):
                (await job).raise_for_status()
            assert not session.failed, "a full disk must fail the job, not the session"
            free_left = shutil.disk_usage(small_fs).free
            await _read_back(session, written)
        print(  # noqa: T201 - the numbers the report quotes
            f"\ndisk full after {len(written)} MiB acknowledged ({free_left} bytes free): "
            f"{full.value.message}"
        )
        assert agent.terminate() == 0, agent.log_path.read_text()

        agent = start_agent(tmp_path, env=env)  # the full store opens again
        async with (
            host_client.Client(agent.address, timeout=30) as client,
            await client.open_session(transport="tcp") as session,
        ):
            assert {v.name for v in await client.list_volumes()} == {first, second}
            await _read_back(session, written)
            await client.delete_volume(first)  # gives its space back
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
    finally:
        assert agent.terminate() == 0, agent.log_path.read_text()

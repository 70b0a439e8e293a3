"""Volume I/O jobs through the agent over tcp: data services, errors, durability."""

import pytest

import host_client
from dpu_wire.v1 import storage_pb2
from tests.scenarios import volume_faults, volume_io

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
    await volume_faults.corrupted_block_is_detected(tmp_path, "tcp", {})


async def test_acknowledged_writes_survive_sigkill_of_the_agent(tmp_path):
    await volume_faults.acknowledged_writes_survive_sigkill(tmp_path, "tcp", {})


async def test_writes_cancelled_while_qos_holds_them_leave_no_debt(agent):
    """Writes a volume's QoS holds that the host cancels never run, and give back the
    tokens they had yet to wait for: the next write waits its own turn, not theirs
    (storage.proto QosLimits). Before, each left its whole cost as the volume's debt."""
    async with (
        host_client.Client(agent.address) as client,
        await client.open_session(transport="tcp", queue_depth=64) as session,
    ):
        name = "volumes/qos-cancelled"
        await client.create_volume("qos-cancelled", MiB, qos=storage_pb2.QosLimits(write_iops=10))
        src = await session.alloc(4096, readable=True)
        # 10 writes go at once (the burst), the 40 others wait their turn: 0.1 s to 4 s
        jobs = [await session.submit_volume_write(name, i * 4096, src) for i in range(50)]
        for job in jobs[10:]:
            await session.cancel(job)
        states = [(await job).state for job in jobs]
        assert states.count("CANCELLED") >= 30
        before = (await client.get_volume(name)).stats
        await session.write_volume(name, 0, src)
        stats = (await client.get_volume(name)).stats
    assert stats.write_ops == states.count("SUCCEEDED") + 1  # no cancelled write ran
    # The wait the buckets gave the next write (their arithmetic, not a clock reading: a
    # slower machine only refills more meanwhile): 0.1 s at most, 4 s with the debt kept.
    given_s = (stats.throttle_delay_us - before.throttle_delay_us) / 1e6
    assert given_s < 1.0, (
        f"a write waits {given_s:.2f} s for {states.count('CANCELLED')} never done"
    )


async def test_a_volume_job_takes_one_qos_operation_per_chunk(agent):
    """An IOPS limit counts chunks of `[dataplane] chunk_size` (1 MiB), not jobs
    (storage.proto QosLimits): a 4 MiB write past a burst of 2 has 2 chunks wait."""
    async with (
        host_client.Client(agent.address) as client,
        await client.open_session(transport="tcp") as session,
    ):
        name = "volumes/qos-chunks"
        await client.create_volume("qos-chunks", 8 * MiB, qos=storage_pb2.QosLimits(write_iops=2))
        src = await session.alloc(4 * MiB, readable=True)
        await session.write_volume(name, 0, src)
        stats = (await client.get_volume(name)).stats
    assert stats.throttled_ops == 2, stats  # the 3rd and 4th MiB; one job would be 0

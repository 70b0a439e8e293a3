"""The agent SIGKILLed while a host has many volume writes in flight (tcp and verbs suites).

Writers run concurrently on one session, each writing fresh random data to a slot of
a volume nobody wrote before, by the capsule path or by SubmitJob, with FUA or
without (then a flush after a few writes). After `KILL_AFTER` acknowledgements the
agent gets SIGKILL. Then:

- every writer ends with UnavailableError (also the ones that were about to submit)
  and the session says it failed;
- an agent restarted on the same storage directory has every *durable* write byte
  for byte: a FUA write that completed OK, or a plain write that completed OK before
  a flush of its volume that completed OK (the documented guarantees, see
  `VolumeStore.write` and `flush`);
- a write that was in flight, or acknowledged but not yet flushed, reads as the old
  contents (zeros) or the new data, never as an error or as anything else;
- the host continues: a new session writes and reads back more.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
from typing import TYPE_CHECKING

import host_client
from dpu_wire.v1 import job_pb2
from tests.faults.common import MiB, random_blocks
from tests.integration.conftest import start_agent

if TYPE_CHECKING:
    from pathlib import Path

    from tests.integration.conftest import AgentProcess

VOLUMES = {  # id -> data services (create_volume keyword arguments)
    "inflight-lz4": {"crc32c": True, "compression": "lz4"},
    "inflight-sealed": {"crc32c": True, "compression": "zstd", "encryption": "aes-xts-256"},
}
VOLUME_BYTES = 64 * MiB
WRITE_BYTES = 64 << 10
WRITERS = 12
QUEUE_DEPTH = 16
KILL_AFTER = 240  # acknowledged writes before the SIGKILL
FLUSH_EVERY = 4  # plain writes between two flushes
Slot = tuple[str, int]  # (volume name, byte offset)


@dataclasses.dataclass
class Ledger:
    """What the host knows about each slot it wrote."""

    durable: dict[Slot, bytes] = dataclasses.field(default_factory=dict)
    in_doubt: dict[Slot, bytes] = dataclasses.field(default_factory=dict)  # may or may not be
    acknowledged: int = 0
    by_path: dict[str, int] = dataclasses.field(default_factory=dict)
    next_offset: dict[str, int] = dataclasses.field(default_factory=dict)

    def take_slot(self, volume: str) -> Slot:
        """A slot of `volume` nobody wrote before."""
        offset = self.next_offset.get(volume, 0)
        if offset + WRITE_BYTES > VOLUME_BYTES:
            raise AssertionError("the volume is full before the kill; raise VOLUME_BYTES")
        self.next_offset[volume] = offset + WRITE_BYTES
        return volume, offset


def _write_spec(buffer: host_client.Buffer, volume: str, offset: int, fua: bool) -> job_pb2.JobSpec:
    spec = job_pb2.JobSpec()
    spec.volume_write.volume = volume
    spec.volume_write.offset = offset
    spec.volume_write.fua = fua
    spec.volume_write.source.CopyFrom(buffer.ref().region_ref())
    return spec


def _flush_spec(volume: str) -> job_pb2.JobSpec:
    spec = job_pb2.JobSpec()
    spec.volume_flush.volume = volume
    return spec


async def _writer(
    index: int, session: host_client.Session, buffer: host_client.Buffer, ledger: Ledger
) -> BaseException | None:
    """Write until the data plane fails; return that error (None would be a bug)."""
    volume = f"volumes/{list(VOLUMES)[index % len(VOLUMES)]}"
    by_rpc = index % 4 in (1, 3)  # SubmitJob, or capsules
    fua = index % 4 in (0, 1)
    path = f"{'rpc' if by_rpc else 'capsule'}-{'fua' if fua else 'flush'}"
    unflushed: list[Slot] = []
    try:
        while True:
            slot = ledger.take_slot(volume)
            data = random_blocks(WRITE_BYTES)
            buffer.view[:] = data
            ledger.in_doubt[slot] = data
            if by_rpc:
                job = await session.submit_spec(_write_spec(buffer, volume, slot[1], fua))
            else:
                job = await session.submit_volume_write(volume, slot[1], buffer, fua=fua)
            (await job).raise_for_status()
            ledger.acknowledged += 1
            ledger.by_path[path] = ledger.by_path.get(path, 0) + 1
            if fua:
                ledger.durable[slot] = ledger.in_doubt.pop(slot)
                continue
            unflushed.append(slot)
            if len(unflushed) == FLUSH_EVERY:
                if by_rpc:
                    flush = await session.submit_spec(_flush_spec(volume))
                else:
                    flush = await session.submit_volume_flush(volume)
                (await flush).raise_for_status()
                for done in unflushed:  # acknowledged before the flush was submitted
                    ledger.durable[done] = ledger.in_doubt.pop(done)
                unflushed.clear()
    except Exception as exc:  # noqa: BLE001 - the caller checks which error it was
        return exc


async def _enough_acknowledged(ledger: Ledger) -> None:
    while ledger.acknowledged < KILL_AFTER:  # noqa: ASYNC110 - a counter, no event to wait on
        await asyncio.sleep(0.005)


async def _write_then_kill(
    agent: AgentProcess, session: host_client.Session, ledger: Ledger
) -> int:
    """Write from every writer, SIGKILL the agent, check the errors; return how many
    writes were in doubt at the kill."""
    buffers = [await session.alloc(WRITE_BYTES, readable=True) for _ in range(WRITERS)]
    for volume_id in VOLUMES:
        await session.attach(f"volumes/{volume_id}")
    writers = [asyncio.create_task(_writer(i, session, buffers[i], ledger)) for i in range(WRITERS)]
    killer = asyncio.create_task(_enough_acknowledged(ledger))
    done, _ = await asyncio.wait([killer, *writers], return_when=asyncio.FIRST_COMPLETED)
    assert killer in done, f"a writer stopped before the kill: {[w.result() for w in done]}"
    in_flight_at_kill = len(ledger.in_doubt)
    agent.proc.send_signal(signal.SIGKILL)
    agent.proc.wait(30)
    errors = await asyncio.wait_for(asyncio.gather(*writers), 60)
    for error in errors:
        assert isinstance(error, host_client.UnavailableError), repr(error)
        assert error.message, "the error does not say what happened"
    assert session.failed
    return in_flight_at_kill


async def acknowledged_writes_survive(
    tmp_path: Path, transport: str, env: dict[str, str]
) -> Ledger:
    """Run the scenario (see the module doc); return what was written."""
    env = {**env, "DPU_AGENT_STORAGE_DIR": str(tmp_path / "store")}
    agent = start_agent(tmp_path, env=env)
    ledger = Ledger()
    try:
        async with host_client.Client(agent.address, timeout=30) as client:
            for volume_id, services in VOLUMES.items():
                await client.create_volume(volume_id, VOLUME_BYTES, **services)  # type: ignore[arg-type]
            async with await client.open_session(
                transport=transport, queue_depth=QUEUE_DEPTH
            ) as session:
                in_flight_at_kill = await _write_then_kill(agent, session, ledger)
    finally:
        if agent.proc.poll() is None:  # a failure before the kill
            agent.proc.kill()
            agent.proc.wait(30)
    print(  # noqa: T201 - the numbers the report quotes
        f"\nkilled after {ledger.acknowledged} acknowledged writes {ledger.by_path}; "
        f"{len(ledger.durable)} durable, {len(ledger.in_doubt)} in doubt "
        f"({in_flight_at_kill} unacknowledged or unflushed at the kill)"
    )
    assert len(ledger.durable) >= KILL_AFTER // 2, "too few durable writes to mean anything"

    restarted = start_agent(tmp_path, env=env)
    try:
        async with (
            host_client.Client(restarted.address, timeout=30) as client,
            await client.open_session(transport=transport, queue_depth=QUEUE_DEPTH) as session,
        ):
            volumes = {v.name for v in await client.list_volumes()}
            assert volumes == {f"volumes/{v}" for v in VOLUMES}, volumes
            dst = await session.alloc(WRITE_BYTES, writable=True)
            for (volume, offset), data in ledger.durable.items():
                await session.read_volume(volume, offset, dst)
                assert dst.view == data, f"acknowledged write lost: {volume} at {offset}"
            zeros = bytes(WRITE_BYTES)
            for (volume, offset), data in ledger.in_doubt.items():
                await session.read_volume(volume, offset, dst)  # never DATA_LOSS
                assert dst.view in (data, zeros), f"a torn write: {volume} at {offset}"
            await _continue(session, ledger)
    finally:
        assert restarted.terminate() == 0, restarted.log_path.read_text()
    return ledger


async def _continue(session: host_client.Session, ledger: Ledger) -> None:
    """The host goes on after the restart: more writes, both paths, all read back."""
    src = await session.alloc(WRITE_BYTES, readable=True)
    dst = await session.alloc(WRITE_BYTES, writable=True)
    for index in range(16):
        volume, offset = ledger.take_slot(f"volumes/{list(VOLUMES)[index % len(VOLUMES)]}")
        data = random_blocks(WRITE_BYTES)
        src.view[:] = data
        if index % 2:
            job = await session.submit_spec(_write_spec(src, volume, offset, True))
            (await job).raise_for_status()
        else:
            await session.write_volume(volume, offset, src, fua=True)
        await session.read_volume(volume, offset, dst)
        assert dst.view == data, f"a write after the restart differs: {volume} at {offset}"

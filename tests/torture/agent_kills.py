"""Real SIGKILLs of the agent while hosts overwrite volumes (tcp on the host, verbs in the VM).

The store directory lives across `KILLS` agent processes. Before the first kill every
block of every volume is written and flushed, so each later write overwrites live
data (the case engine v1 lost blocks in). Each round: an agent starts on the
directory (recovering from the last kill), a session's writers overwrite slots of
every volume (4 blocks per job, random content, FUA or plain with a flush every few
writes) and a snapshot is taken; after a random number of acknowledgements (and, in
half the rounds, once the snapshot is acknowledged) the agent gets SIGKILL. The next
round's agent must then read every block as its last durable version or a later
write's whole content (model.py), with no DATA_LOSS, and hold every acknowledged
snapshot as it was taken.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
from typing import TYPE_CHECKING, Final

import host_client
from tests.integration.conftest import start_agent
from tests.torture.model import Model, Version, VolumeModel

if TYPE_CHECKING:
    from pathlib import Path

    from tests.integration.conftest import AgentProcess

BLOCK: Final = 4096
SLOT_BLOCKS: Final = 4
SLOTS: Final = 32
VOLUME_BYTES: Final = SLOTS * SLOT_BLOCKS * BLOCK
VOLUMES: Final = {  # id -> create_volume keyword arguments
    "kill-crc": {"crc32c": True},
    "kill-lz4": {"crc32c": True, "compression": "lz4"},
    "kill-xts": {"crc32c": True, "encryption": "aes-xts-256"},
    "kill-zstd-xts": {"crc32c": True, "compression": "zstd", "encryption": "aes-xts-256"},
    "kill-plain": {},
}
WRITERS: Final = 6
FLUSH_EVERY: Final = 3


@dataclasses.dataclass
class Summary:
    """What the rounds did (printed for the report)."""

    kills: int = 0
    acknowledged: int = 0
    durable: int = 0
    in_doubt_at_kills: int = 0
    blocks_checked: int = 0
    snapshots_checked: int = 0
    violations: list[str] = dataclasses.field(default_factory=list)

    def line(self) -> str:
        return (
            f"{self.kills} SIGKILLs, {self.acknowledged} slot writes acknowledged "
            f"({self.durable} durable), {self.in_doubt_at_kills} in doubt at the kills, "
            f"{self.blocks_checked} blocks and {self.snapshots_checked} snapshots checked: "
            f"{len(self.violations)} violations"
        )


class Rounds:
    """The model, the store directory and the agent of the current round."""

    def __init__(self, tmp_path: Path, transport: str, env: dict[str, str], seed: int) -> None:
        self.tmp_path = tmp_path
        self.transport = transport
        self.env = {**env, "DPU_AGENT_STORAGE_DIR": str(tmp_path / "store")}
        self.rng = random.Random(seed)  # noqa: S311 - test data, not secrets
        self.model = Model()
        self.summary = Summary()
        self.snapshots: dict[str, list[list[bytes]]] = {}  # acknowledged -> candidates
        self.deleting: set[str] = set()  # snapshots whose delete was asked
        self.round = 0
        self.dead = False

    def killed(self) -> bool:
        """True once this round's agent got its SIGKILL (what completes later is in doubt)."""
        return self.dead

    def client(self, agent: AgentProcess) -> host_client.Client:
        return host_client.Client(agent.address, timeout=30)

    async def setup(self) -> None:
        agent = start_agent(self.tmp_path, env=self.env)
        try:
            async with self.client(agent) as client:
                for name, services in VOLUMES.items():
                    await client.create_volume(name, VOLUME_BYTES, **services)  # type: ignore[arg-type]
                    self.model.volumes[name] = VolumeModel(name, BLOCK, SLOTS * SLOT_BLOCKS, {}, [])
                async with await client.open_session(transport=self.transport) as session:
                    buf = await session.alloc(VOLUME_BYTES, readable=True)
                    for name in VOLUMES:
                        data = os.urandom(VOLUME_BYTES)
                        buf.view[:] = data
                        await session.write_volume(f"volumes/{name}", 0, buf, fua=True)
                        self._rebase(name, data)
        finally:
            assert agent.terminate() == 0, agent.log_path.read_text()

    def _rebase(self, name: str, data: bytes) -> None:
        self.model.volumes[name].history = {
            b: [Version(data[b * BLOCK : (b + 1) * BLOCK], 0, 0, durable=True)]
            for b in range(SLOTS * SLOT_BLOCKS)
        }

    # ------------------------------------------------------------ a round

    async def one(self) -> None:
        """Start, check what the last kill left, write, snapshot, kill."""
        self.round += 1
        agent = start_agent(self.tmp_path, env=self.env)
        try:
            async with self.client(agent) as client:
                await self.check(client)
                async with await client.open_session(
                    transport=self.transport, queue_depth=2 * WRITERS
                ) as session:
                    for name in VOLUMES:
                        await session.attach(f"volumes/{name}")
                    await self._write_until_killed(agent, client, session)
        except host_client.UnavailableError:
            pass  # the session or the client saw the kill
        finally:
            if agent.proc.poll() is None:
                agent.proc.kill()
            agent.proc.wait(30)
        self.summary.kills += 1

    async def _write_until_killed(
        self, agent: AgentProcess, client: host_client.Client, session: host_client.Session
    ) -> None:
        acked = [0]
        self.dead = False
        kill_after = self.rng.randint(4, 40)
        buffers = [await session.alloc(SLOT_BLOCKS * BLOCK, readable=True) for _ in range(WRITERS)]
        writers = [
            asyncio.create_task(self._writer(k, session, buffers[k], acked)) for k in range(WRITERS)
        ]
        snapshot = asyncio.create_task(self._snapshot(client))
        # Half the rounds kill only once the snapshot is acknowledged, so some snapshot is
        # always checked however fast the writes are; the other half may cut it mid-way.
        after_snapshot = self.rng.random() < 0.5
        while (  # noqa: ASYNC110
            acked[0] < kill_after or (after_snapshot and not snapshot.done())
        ) and not all(w.done() for w in writers):
            await asyncio.sleep(0.002)
        for w in writers:
            if w.done() and w.exception() is not None:
                raise AssertionError(f"a writer failed before the kill: {w.exception()!r}")
        with self.model.lock:
            self.summary.in_doubt_at_kills += sum(
                1
                for vol in self.model.volumes.values()
                for history in vol.history.values()
                for v in history
                if not v.durable
            )
        agent.proc.send_signal(signal.SIGKILL)
        agent.proc.wait(30)
        self.dead = True
        results = await asyncio.wait_for(
            asyncio.gather(*writers, snapshot, return_exceptions=True), 60
        )
        for result in results:
            if result is not None and not isinstance(result, host_client.UnavailableError):
                raise AssertionError(f"after the kill: {result!r}, not UnavailableError")

    async def _writer(
        self, k: int, session: host_client.Session, buffer: host_client.Buffer, acked: list[int]
    ) -> None:
        rng = random.Random(self.rng.random())  # noqa: S311 - test data, not secrets
        model = self.model
        unflushed: dict[str, int] = {}
        while True:
            name = rng.choice(list(VOLUMES))
            slot = rng.choice([s for s in range(SLOTS) if s % WRITERS == k])
            data = os.urandom(SLOT_BLOCKS * BLOCK)
            buffer.view[:] = data
            fua = rng.random() < 0.4
            versions = [
                model.issue(name, slot * SLOT_BLOCKS + i, data[i * BLOCK : (i + 1) * BLOCK])
                for i in range(SLOT_BLOCKS)
            ]
            with model.lock:
                started = model.tick()
            await session.write_volume(
                f"volumes/{name}", slot * SLOT_BLOCKS * BLOCK, buffer, fua=fua
            )
            if self.killed():
                return
            model.ack(versions, durable=fua)
            acked[0] += 1
            if fua:
                model.committed(name, started)
            unflushed[name] = unflushed.get(name, 0) + (not fua)
            if unflushed[name] >= FLUSH_EVERY:
                with model.lock:
                    started = model.tick()
                (await (await session.submit_volume_flush(f"volumes/{name}"))).raise_for_status()
                if self.killed():
                    return
                model.committed(name, started)
                unflushed[name] = 0

    async def _snapshot(self, client: host_client.Client) -> None:
        """Take a snapshot of the first volume mid-round (deleting the one before)."""
        await asyncio.sleep(self.rng.random() * 0.05)
        for old in list(self.snapshots):
            self.deleting.add(old)
            await client.delete_snapshot(f"snapshots/{old}")
            del self.snapshots[old]
            self.deleting.discard(old)
        name, volume = f"kill-snap-{self.round}", next(iter(VOLUMES))
        with self.model.lock:
            started = self.model.tick()
        await client.create_snapshot(name, f"volumes/{volume}")
        if self.killed():
            return
        with self.model.lock:
            ended = self.model.tick()
            self.snapshots[name] = [
                self.model.current(volume, b, started, ended) for b in range(SLOTS * SLOT_BLOCKS)
            ]
        self.model.committed(volume, started)

    # ------------------------------------------------------------ the check

    async def check(self, client: host_client.Client) -> None:
        """Every block of every volume, and the acknowledged snapshot, against the model."""
        if self.round == 1:
            return
        where = f"after kill {self.round - 1}"
        async with await client.open_session(transport=self.transport) as session:
            buf = await session.alloc(VOLUME_BYTES, writable=True)
            for name in VOLUMES:
                try:
                    await session.read_volume(f"volumes/{name}", 0, buf)
                except host_client.DataLossError as exc:
                    self.summary.violations.append(f"{where}: {name} reads DATA_LOSS: {exc}")
                    continue
                data = bytes(buf.view)
                for b in range(SLOTS * SLOT_BLOCKS):
                    allowed = self.model.allowed(name, b)
                    if data[b * BLOCK : (b + 1) * BLOCK] not in allowed:
                        self.summary.violations.append(
                            f"{where}: {name} block {b} is neither its last durable version "
                            f"nor a later one ({len(allowed)} allowed)"
                        )
                    self.summary.blocks_checked += 1
                self._rebase(name, data)
            await self._check_snapshots(client, session, buf, where)

    async def _check_snapshots(
        self,
        client: host_client.Client,
        session: host_client.Session,
        buf: host_client.Buffer,
        where: str,
    ) -> None:
        present = {s.name for s in await client.list_snapshots()}
        for snap, candidates in list(self.snapshots.items()):
            if f"snapshots/{snap}" not in present:
                if snap not in self.deleting:
                    self.summary.violations.append(f"{where}: acknowledged snapshot {snap} is gone")
                del self.snapshots[snap]
                continue
            await client.clone_volume("kill-probe", f"snapshots/{snap}")
            try:
                await session.read_volume("volumes/kill-probe", 0, buf)
            except host_client.DataLossError as exc:
                self.summary.violations.append(f"{where}: snapshot {snap} reads DATA_LOSS: {exc}")
            await client.delete_volume("volumes/kill-probe")
            data = bytes(buf.view)
            for b, allowed in enumerate(candidates):
                if data[b * BLOCK : (b + 1) * BLOCK] not in allowed:
                    self.summary.violations.append(f"{where}: snapshot {snap} block {b} differs")
            self.snapshots[snap] = [
                [data[b * BLOCK : (b + 1) * BLOCK]] for b in range(len(candidates))
            ]
            self.summary.snapshots_checked += 1
        for extra in present - {f"snapshots/{s}" for s in self.snapshots}:
            await client.delete_snapshot(extra)  # made but not acknowledged: may be there
        self.deleting.clear()

    def finish(self) -> Summary:
        self.summary.acknowledged = self.model.acked_writes // SLOT_BLOCKS
        self.summary.durable = self.model.durable_writes // SLOT_BLOCKS
        return self.summary


async def overwrites_survive_kills(
    tmp_path: Path, transport: str, env: dict[str, str], kills: int
) -> Summary:
    """Run the rounds (see the module doc) and a last check; returns what happened."""
    rounds = Rounds(tmp_path, transport, env, int.from_bytes(os.urandom(4)))
    await rounds.setup()
    for _ in range(kills):
        await rounds.one()
    rounds.round += 1
    agent = start_agent(tmp_path, env=rounds.env)
    try:
        async with rounds.client(agent) as client:
            await rounds.check(client)
    finally:
        assert agent.terminate() == 0, agent.log_path.read_text()
    return rounds.finish()

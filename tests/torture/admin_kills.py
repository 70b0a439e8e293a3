"""Real SIGKILLs of the agent during admin changes, big writes and racing trims (over tcp).

What agent_kills.py does not do: each round, while writers overwrite 64-256 KiB
ranges and a racer trims and overwrites ranges they are writing, an admin resizes a
volume under the writers (shrink with force, grow back), creates a volume, writes it,
snapshots it, clones the snapshot, deletes the volume while the clone lives, writes
the clone, and deletes clones and snapshots of earlier rounds. The agent gets SIGKILL
after a random number of acknowledgements, or (in some rounds) as soon as one of the
checkpoint slots changes, i.e. while the log's checkpoint is being written.
The next round's agent must read every block as the model allows (gaps.LooseModel),
hold every acknowledged snapshot as taken, have every acknowledged create and delete,
and its store directory must not grow round after round.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Final

import host_client
from tests.integration.conftest import start_agent
from tests.torture.gaps import LooseModel
from tests.torture.model import Version, VolumeModel

if TYPE_CHECKING:
    from pathlib import Path

    from tests.integration.conftest import AgentProcess

BLOCK: Final = 4096
BLOCKS: Final = 1024  # 4 MiB per volume
VOLUMES: Final = {
    "ak-crc": {"crc32c": True},
    "ak-lz4": {"crc32c": True, "compression": "lz4"},
    "ak-xts": {"crc32c": True, "compression": "zstd", "encryption": "aes-xts-256"},
    "ak-plain": {},
}
RESIZED: Final = "ak-crc"
BIG: Final = "ak-big"  # written once: its map makes each checkpoint ~1 MiB
BIG_BLOCKS: Final = 1 << 16
WRITERS: Final = 4
SIZES: Final = (16, 32, 64)  # blocks: 64, 128, 256 KiB


@dataclasses.dataclass
class Summary:
    kills: int = 0
    kills_at_checkpoint: int = 0
    kills_while_closing: int = 0
    kills_while_starting: int = 0
    acknowledged: int = 0
    admin_ops: int = 0
    blocks_checked: int = 0
    snapshots_checked: int = 0
    store_bytes: list[int] = dataclasses.field(default_factory=list)
    pool_bytes: list[int] = dataclasses.field(default_factory=list)
    violations: list[str] = dataclasses.field(default_factory=list)

    def line(self) -> str:
        return (
            f"{self.kills} SIGKILLs ({self.kills_at_checkpoint} as a checkpoint slot changed, "
            f"{self.kills_while_closing} after a SIGTERM, while closing), "
            f"{self.kills_while_starting} more while an agent started on the store, "
            f"{self.acknowledged} block writes acknowledged, {self.admin_ops} admin ops "
            f"acknowledged, {self.blocks_checked} blocks and {self.snapshots_checked} snapshots "
            f"checked, store bytes {self.store_bytes[:3]}..{self.store_bytes[-3:]}: "
            f"{len(self.violations)} violations"
        )


class Rounds:
    def __init__(self, tmp_path: Path, seed: int) -> None:
        self.tmp_path = tmp_path
        self.store = tmp_path / "store"
        self.env = {"DPU_AGENT_STORAGE_DIR": str(self.store)}
        self.rng = random.Random(seed)  # noqa: S311 - test data, not secrets
        self.model = LooseModel()
        self.summary = Summary()
        # snapshot -> (its volume's block candidates, acknowledged); clones: name -> snapshot
        self.snapshots: dict[str, list[list[bytes]]] = {}
        self.snap_pending: dict[str, list[list[bytes]]] = {}  # asked, not acknowledged
        self.clones: dict[str, str] = {}
        self.maybe: set[str] = set()  # names whose create or delete is in doubt
        self.gone: set[str] = set()  # acknowledged deleted
        self.resizing = False
        self.round = 0
        self.dead = False

    def killed(self) -> bool:
        """True once this round's agent got its SIGKILL (what completes later is in doubt)."""
        return self.dead

    def client(self, agent: AgentProcess) -> host_client.Client:
        return host_client.Client(agent.address, timeout=60)

    async def setup(self) -> None:
        agent = start_agent(self.tmp_path, env=self.env)
        try:
            async with self.client(agent) as client:
                for name, services in VOLUMES.items():
                    await client.create_volume(name, BLOCKS * BLOCK, **services)  # type: ignore[arg-type]
                    self.model.volumes[name] = VolumeModel(name, BLOCK, BLOCKS, {}, [BLOCKS])
                await client.create_volume(BIG, BIG_BLOCKS * BLOCK)
                async with await client.open_session() as session:
                    buf = await session.alloc(1 << 20, readable=True)
                    for at in range(0, BIG_BLOCKS * BLOCK, 1 << 20):
                        buf.view[:] = os.urandom(1 << 20)
                        await session.write_volume(f"volumes/{BIG}", at, buf)
                    buf.view[:] = bytes(1 << 20)
                    for name in VOLUMES:  # every block written, so every write overwrites
                        for at in range(0, BLOCKS * BLOCK, 1 << 20):
                            await session.write_volume(f"volumes/{name}", at, buf, fua=True)
        finally:
            assert agent.terminate() == 0, agent.log_path.read_text()

    # ------------------------------------------------------------ a round

    def _doomed_start(self) -> None:
        """Start an agent on the store and SIGKILL it while it starts (recovering)."""
        environ = {
            **os.environ,
            "DPU_AGENT_NETWORK_RULES_FILE": str(self.tmp_path / "doomed-flow-rules.json"),
            "DPU_AGENT_METRICS_LISTEN": "127.0.0.1:0",
            "DPU_AGENT_VIRT_STATE_FILE": str(self.tmp_path / "doomed-functions.json"),
            "DPU_AGENT_TLS_PLAINTEXT_LOOPBACK": "1",
            **self.env,
        }
        cmd = [sys.executable, "-m", "dpu_agent", "serve", "--listen", "127.0.0.1:0"]
        with (self.tmp_path / "doomed.log").open("ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=environ)
        time.sleep(0.2 + self.rng.random() * 1.5)
        if proc.poll() is None:
            self.summary.kills_while_starting += 1
        proc.kill()
        proc.wait(30)

    async def one(self) -> None:
        self.round += 1
        if self.rng.random() < 0.3:
            self._doomed_start()
        agent = start_agent(self.tmp_path, env=self.env)
        try:
            async with self.client(agent) as client:
                await self.check(client)
                self._measure()
                async with await client.open_session(queue_depth=4 * WRITERS) as session:
                    for name in VOLUMES:
                        await session.attach(f"volumes/{name}")
                    await self._until_killed(agent, client, session)
        except host_client.UnavailableError:
            pass
        finally:
            if agent.proc.poll() is None:
                agent.proc.kill()
            agent.proc.wait(30)
        self.summary.kills += 1

    def _measure(self) -> None:
        total = 0
        for path in self.store.iterdir():
            st = path.stat()
            total += st.st_blocks * 512
            if path.name == "pool":
                self.summary.pool_bytes.append(st.st_size)
        self.summary.store_bytes.append(total)

    def _slots(self) -> tuple[tuple[int, int], ...]:
        found = []
        for name in ("checkpoint.0", "checkpoint.1"):
            try:
                st = (self.store / name).stat()
            except FileNotFoundError:
                found.append((0, 0))
            else:
                found.append((st.st_mtime_ns, st.st_size))
        return tuple(found)

    async def _until_killed(
        self, agent: AgentProcess, client: host_client.Client, session: host_client.Session
    ) -> None:
        self.dead = False
        acked = [0]
        at_checkpoint = self.rng.random() < 0.4
        kill_after = self.rng.randint(10, 120)
        tasks = [asyncio.create_task(self._writer(k, session, acked)) for k in range(WRITERS)]
        tasks.append(asyncio.create_task(self._racer(session, acked)))
        tasks.append(asyncio.create_task(self._admin(client, session)))
        slots = self._slots()
        deadline = asyncio.get_running_loop().time() + 20
        while not any(t.done() for t in tasks[:WRITERS]):
            if at_checkpoint:
                if self._slots() != slots or asyncio.get_running_loop().time() > deadline:
                    self.summary.kills_at_checkpoint += self._slots() != slots
                    break
            elif acked[0] >= kill_after:
                break
            await asyncio.sleep(0.001)
        for t in tasks:
            if t.done() and t.exception() is not None:  # the admin's may be done: fine
                raise AssertionError(f"a task failed before the kill: {t.exception()!r}")
        if self.rng.random() < 0.3:  # SIGTERM, then SIGKILL while it closes (its checkpoint)
            self.dead = True
            self.summary.kills_while_closing += 1
            agent.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(self.rng.random() * 0.2)
        agent.proc.send_signal(signal.SIGKILL)
        agent.proc.wait(30)
        self.dead = True
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
        for result in results:
            if result is not None and not isinstance(result, host_client.UnavailableError):
                raise AssertionError(f"after the kill: {result!r}, not UnavailableError")

    async def _write(
        self,
        session: host_client.Session,
        buffer: host_client.Buffer,
        name: str,
        first: int,
        count: int,
        *,
        fua: bool,
        content: bytes | None = None,
    ) -> bool:
        """Write and model it; False once the agent is dead."""
        model = self.model
        data = content if content is not None else os.urandom(count * BLOCK)
        buffer.view[: count * BLOCK] = data
        versions = [
            model.issue(name, first + i, data[i * BLOCK : (i + 1) * BLOCK]) for i in range(count)
        ]
        with model.lock:
            started = model.tick()
        try:
            await session.write_volume(
                f"volumes/{name}", first * BLOCK, buffer[: count * BLOCK], fua=fua
            )
        except (host_client.InvalidArgumentError, host_client.DpuError) as exc:
            if isinstance(exc, (host_client.UnavailableError, host_client.DataLossError)):
                raise
            if self.killed():
                return False
            if name == RESIZED or name in self.clones or name.startswith("akx"):
                model.forget(name, versions)  # shrunk, or deleted, under it
                return True
            raise
        if self.killed():
            return False
        model.ack(versions, durable=fua)
        self.summary.acknowledged += count
        if fua:
            model.committed(name, started)
        return True

    async def _writer(self, k: int, session: host_client.Session, acked: list[int]) -> None:
        rng = random.Random(self.rng.random())  # noqa: S311
        buffer = await session.alloc(max(SIZES) * BLOCK, readable=True)
        share = BLOCKS // WRITERS
        unflushed = 0
        while not self.killed():
            name = rng.choice(list(VOLUMES))
            count = rng.choice(SIZES)
            first = k * share + rng.randrange(0, share - count + 1)
            fua = rng.random() < 0.3
            if not await self._write(session, buffer, name, first, count, fua=fua):
                return
            acked[0] += 1
            unflushed += not fua
            if unflushed >= 3:
                with self.model.lock:
                    started = self.model.tick()
                (await (await session.submit_volume_flush(f"volumes/{name}"))).raise_for_status()
                if self.killed():
                    return
                for vol in VOLUMES:  # a flush commits every volume
                    self.model.committed(vol, started)
                unflushed = 0

    async def _racer(self, session: host_client.Session, acked: list[int]) -> None:
        rng = random.Random(self.rng.random())  # noqa: S311
        buffer = await session.alloc(16 * BLOCK, readable=True)
        model = self.model
        while not self.killed():
            await asyncio.sleep(rng.random() * 0.01)
            name = rng.choice(list(VOLUMES))
            count = rng.randint(1, 16)
            first = rng.randrange(0, BLOCKS - count + 1)
            if rng.random() < 0.5:
                if not await self._write(
                    session, buffer, name, first, count, fua=rng.random() < 0.5
                ):
                    return
                continue
            versions = [model.issue(name, first + i, bytes(BLOCK)) for i in range(count)]
            with model.lock:
                started = model.tick()
            done = await (
                await session.submit_volume_trim(f"volumes/{name}", first * BLOCK, count * BLOCK)
            )
            if self.killed():
                return
            try:
                done.raise_for_status()
            except host_client.DpuError as exc:
                if isinstance(exc, (host_client.UnavailableError, host_client.DataLossError)):
                    raise
                if name != RESIZED:
                    raise
                model.forget(name, versions)
                continue
            model.ack(versions, durable=True)
            model.committed(name, started)
            acked[0] += 1

    # ------------------------------------------------------------ admin

    async def _admin(self, client: host_client.Client, session: host_client.Session) -> None:
        rng = random.Random(self.rng.random())  # noqa: S311
        buffer = await session.alloc(64 * BLOCK, readable=True)
        await self._cleanup(client)
        ops = [self._resize, self._snapshot_clone_delete]
        rng.shuffle(ops)
        for op in ops:
            await asyncio.sleep(rng.random() * 0.05)
            if self.killed():
                return
            await op(client, session, buffer, rng)

    async def _acked(self, _what: str, call: object) -> bool:
        """Await an admin call; True if it returned before the kill."""
        await call  # type: ignore[misc]
        if self.killed():
            return False
        self.summary.admin_ops += 1
        return True

    async def _cleanup(self, client: host_client.Client) -> None:
        """Delete what earlier rounds left: clones and base volumes, then snapshots."""
        leftover = [name for name in self.model.volumes if name.startswith("akx")]
        for clone in dict.fromkeys([*self.clones, *leftover]):
            self.maybe.add(clone)
            if not await self._acked("delete", client.delete_volume(f"volumes/{clone}")):
                return
            self._deleted(clone)
            self.clones.pop(clone, None)
        for snap in list(self.snapshots):
            self.maybe.add(snap)
            if not await self._acked("delete", client.delete_snapshot(f"snapshots/{snap}")):
                return
            self._deleted(snap)
            del self.snapshots[snap]

    def _deleted(self, name: str) -> None:
        self.maybe.discard(name)
        self.gone.add(name)
        self.model.volumes.pop(name, None)

    async def _resize(self, client, _session, _buffer, rng) -> None:
        model = self.model
        vol = model.volumes[RESIZED]
        keep = rng.randrange(BLOCKS // 4, BLOCKS)
        with model.lock:
            vol.sizes = sorted({*vol.sizes, keep})
        versions = [model.issue(RESIZED, b, bytes(BLOCK)) for b in range(keep, BLOCKS)]
        with model.lock:
            started = model.tick()
        if not await self._acked(
            "shrink", client.resize_volume(f"volumes/{RESIZED}", keep * BLOCK, force=True)
        ):
            return
        model.ack(versions, durable=True)
        model.committed(RESIZED, started)
        with model.lock:
            vol.sizes = [keep, BLOCKS]
        await asyncio.sleep(rng.random() * 0.02)
        if not await self._acked(
            "grow", client.resize_volume(f"volumes/{RESIZED}", BLOCKS * BLOCK)
        ):
            return
        with model.lock:
            vol.sizes = [BLOCKS]

    async def _snapshot_clone_delete(self, client, session, buffer, rng) -> None:
        model = self.model
        base, snap, clone = f"akx{self.round}", f"aks{self.round}", f"akc{self.round}"
        self.maybe.add(base)
        if not await self._acked("create", client.create_volume(base, 64 * BLOCK, crc32c=True)):
            return
        self.maybe.discard(base)
        model.volumes[base] = VolumeModel(base, BLOCK, 64, {}, [64])
        await session.attach(f"volumes/{base}")
        if not await self._write(session, buffer, base, 0, 64, fua=rng.random() < 0.5):
            return
        with model.lock:
            started = model.tick()
        self.maybe.add(snap)
        self.snap_pending[snap] = []
        call = client.create_snapshot(snap, f"volumes/{base}")
        ok = await self._acked("snapshot", call)
        with model.lock:
            ended = model.tick()
            candidates = [model.current(base, b, started, ended) for b in range(64)]
        self.snap_pending[snap] = candidates
        if not ok:
            return
        self.maybe.discard(snap)
        del self.snap_pending[snap]
        self.snapshots[snap] = candidates
        model.committed(base, started)
        self.maybe.add(clone)
        if not await self._acked("clone", client.clone_volume(clone, f"snapshots/{snap}")):
            return
        self.maybe.discard(clone)
        self.clones[clone] = snap
        history = {
            b: [Version(c, 1, 1, durable=True) for c in cs] for b, cs in enumerate(candidates)
        }
        model.volumes[clone] = VolumeModel(clone, BLOCK, 64, history, [64])
        model.volumes[clone].snapshot = snap
        self.maybe.add(base)
        if not await self._acked("delete base", client.delete_volume(f"volumes/{base}")):
            return
        self._deleted(base)
        await session.attach(f"volumes/{clone}")
        first = rng.randrange(0, 32)
        await self._write(session, buffer, clone, first, 32, fua=rng.random() < 0.5)

    # ------------------------------------------------------------ the check

    async def check(self, client: host_client.Client) -> None:
        """Every name, volume block and snapshot against the model; then re-base on it."""
        if self.round == 1:
            return
        where = f"after kill {self.round - 1}"
        vols = {v.name.removeprefix("volumes/"): v.size_bytes for v in await client.list_volumes()}
        snaps = {s.name.removeprefix("snapshots/") for s in await client.list_snapshots()}
        self._check_names(where, vols, snaps)
        async with await client.open_session() as session:
            buf = await session.alloc(BLOCKS * BLOCK, writable=True)
            for name, vol in list(self.model.volumes.items()):
                await self._check_volume(where, session, buf, vol, vols[name] // BLOCK)
            for snap, candidates in list(self.snapshots.items()):
                await self._check_snapshot(where, client, session, buf, snap, candidates)
        for extra in snaps - set(self.snapshots):
            self.snapshots[extra] = []  # unknown: deleted next round
        for extra in set(vols) - set(self.model.volumes) - {BIG} - set(self.clones):
            self.clones[extra] = ""

    def _check_names(self, where: str, vols: dict[str, int], snaps: set[str]) -> None:
        """Acknowledged creates and deletes hold; what was in doubt is adopted as found."""
        for name in self.gone:
            if name in vols or name in snaps:
                self.summary.violations.append(f"{where}: deleted {name} is back")
        self.gone.clear()
        for name in list(self.model.volumes):
            if name not in vols and name not in self.maybe:
                self.summary.violations.append(f"{where}: volume {name} is gone")
                self.model.volumes.pop(name)
        for snap in list(self.snapshots):
            if snap not in snaps and snap not in self.maybe:
                self.summary.violations.append(f"{where}: snapshot {snap} is gone")
                del self.snapshots[snap]
        self._adopt_in_doubt(vols, snaps)

    def _adopt_in_doubt(self, vols: dict[str, int], snaps: set[str]) -> None:
        """Creates and deletes the kill cut short: what is there is what the model takes."""
        for name in self.maybe:
            if name in snaps:
                if name in self.snap_pending and name not in self.snapshots:
                    self.snapshots[name] = self.snap_pending[name]
            elif name in self.snapshots:
                del self.snapshots[name]
            if name in vols and name not in self.model.volumes:
                # a clone in doubt: deleted next round; a base volume too (unchecked)
                self.clones[name] = name.replace("akc", "aks") if name.startswith("akc") else ""
            elif name not in vols:
                self.model.volumes.pop(name, None)
                self.clones.pop(name, None)
        self.maybe.clear()
        self.snap_pending.clear()

    async def _check_volume(
        self,
        where: str,
        session: host_client.Session,
        buf: host_client.Buffer,
        vol: VolumeModel,
        size: int,
    ) -> None:
        name = vol.name
        if size not in vol.sizes:
            self.summary.violations.append(f"{where}: {name} has {size} blocks, not {vol.sizes}")
        try:
            await session.read_volume(f"volumes/{name}", 0, buf[: size * BLOCK])
        except host_client.DataLossError as exc:
            self.summary.violations.append(f"{where}: {name} reads DATA_LOSS: {exc}")
            return
        data = bytes(buf.view[: size * BLOCK])
        history = {}
        for b in range(size):
            got = data[b * BLOCK : (b + 1) * BLOCK]
            if b in vol.history or name in VOLUMES:
                allowed = self.model.allowed(name, b)
                if got not in allowed:
                    self.summary.violations.append(
                        f"{where}: {name} block {b} reads {got[:8].hex()}, "
                        f"not one of {len(allowed)} allowed"
                    )
            self.summary.blocks_checked += 1
            history[b] = [Version(got, 0, 0, durable=True)]
        vol.history, vol.sizes, vol.blocks = history, [size], size

    async def _check_snapshot(
        self,
        where: str,
        client: host_client.Client,
        session: host_client.Session,
        buf: host_client.Buffer,
        snap: str,
        candidates: list[list[bytes]],
    ) -> None:
        probe = f"akprobe{self.round}"
        await client.clone_volume(probe, f"snapshots/{snap}")
        try:
            await session.read_volume(f"volumes/{probe}", 0, buf[: 64 * BLOCK])
        except host_client.DataLossError as exc:
            self.summary.violations.append(f"{where}: snapshot {snap} DATA_LOSS: {exc}")
        await client.delete_volume(f"volumes/{probe}")
        data = bytes(buf.view[: 64 * BLOCK])
        for b, allowed in enumerate(candidates):
            if data[b * BLOCK : (b + 1) * BLOCK] not in allowed:
                self.summary.violations.append(f"{where}: snapshot {snap} block {b} differs")
        self.snapshots[snap] = [[data[b * BLOCK : (b + 1) * BLOCK]] for b in range(64)]
        self.summary.snapshots_checked += 1


async def admin_kills(tmp_path: Path, kills: int, seed: int | None = None) -> Summary:
    seed = int.from_bytes(os.urandom(4)) if seed is None else seed
    rounds = Rounds(tmp_path, seed)
    await rounds.setup()
    for _ in range(kills):
        await rounds.one()
    rounds.round += 1
    agent = start_agent(tmp_path, env=rounds.env)
    try:
        async with rounds.client(agent) as client:
            await rounds.check(client)
            rounds._measure()
    finally:
        assert agent.terminate() == 0, agent.log_path.read_text()
    summary = rounds.summary
    if summary.violations:
        summary.violations.insert(0, f"seed {seed}")
    return summary

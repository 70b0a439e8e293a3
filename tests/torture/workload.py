"""Power-cut torture: a random workload on the store over a FaultyMedia, cut, recovered, checked.

One `Torture` keeps a store image across many cycles. Each cycle opens the store on
the image the last power cut left (so recovery runs every time, and may itself be
cut), runs writers and an admin thread until the power goes at a random media
operation, then checks the image with a fresh store: every block, volume and
snapshot against the model (model.py). The next cycle starts from the same image.

Workload: a volume per data-service combination (alternating 512- and 4096-byte
blocks). `WRITERS` threads each own a slice of every volume's blocks and write
1-4 blocks at a time (random, compressible or mostly-zero content, each version
tagged so no two are alike), FUA or not, flush, and trim; the admin thread grows a
volume's tail, writes it and shrinks it back, takes snapshots, clones them, writes
the clones, and deletes clones and snapshots.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
import random
import struct
import threading
from typing import TYPE_CHECKING, Final

from dpu_agent.errors import AgentError, NotFound
from dpu_agent.storage import Compression, DataServices, Encryption
from dpu_agent.storage.engine import CowVolumeStore
from dpu_agent.storage.errors import DataCorruption
from dpu_agent.storage.keys import KeySealer
from tests.torture.faulty_media import FaultyMedia
from tests.torture.model import FROM_SNAPSHOT, Model, SnapshotModel, Version, VolumeModel

if TYPE_CHECKING:
    from collections.abc import Callable

SERVICES: Final = [
    DataServices(crc, comp, enc)
    for crc, comp, enc in itertools.product((False, True), tuple(Compression), tuple(Encryption))
]
BLOCKS: Final = 32  # per volume, for the writers
TAIL: Final = 8  # blocks the admin grows a volume by, writes, and shrinks away
WRITERS: Final = 3
OPS_PER_WRITER: Final = 12
ADMIN_OPS: Final = 4
READS: Final = 12
MAX_SNAPSHOTS: Final = 5
MAX_CLONES: Final = 3
MASTER_KEY: Final = bytes(range(32))
KEEP: Final = (0.0, 0.25, 0.5, 0.75, 1.0)  # chance that a queued write survives a cut whole
TEAR: Final = (0.0, 0.3, 0.6)  # chance that it is torn (and lost otherwise)
CHECKPOINT_LOG_BYTES: Final = 8 << 10  # a checkpoint every few log blocks


def _batch(store: CowVolumeStore, writes: list[tuple[str, int, bytes]]) -> None:
    """`write_batch`, raising the first write's error (the batch is acknowledged whole)."""
    for error in store.write_batch(writes):
        if error is not None:
            raise error


def volume_name(i: int) -> str:
    return f"v{i}"


def block_size_of(i: int) -> int:
    return 4096 if i % 2 == 0 else 512


@dataclasses.dataclass
class Stats:
    """What the runs did (printed for the report)."""

    cycles: int = 0
    cut_while_opening: int = 0
    sectors_torn: int = 0
    sectors_kept: int = 0
    acked_writes: int = 0
    durable_writes: int = 0
    blocks_checked: int = 0
    snapshots_checked: int = 0
    reads_checked: int = 0
    violations: list[str] = dataclasses.field(default_factory=list)

    def line(self) -> str:
        return (
            f"{self.cycles} power cuts ({self.cut_while_opening} during recovery), "
            f"{self.sectors_torn} queued sectors lost and {self.sectors_kept} kept at the cuts, "
            f"{self.acked_writes} block writes acknowledged ({self.durable_writes} made durable "
            f"by a later flush), {self.reads_checked} blocks read while writing, "
            f"{self.blocks_checked} blocks and {self.snapshots_checked} snapshots checked after "
            f"the cuts: {len(self.violations)} violations"
        )


class Torture:
    """The store image, the model, and the cycles (see the module doc)."""

    def __init__(
        self,
        seed: int,
        *,
        store_factory: Callable[..., CowVolumeStore] = CowVolumeStore,
    ) -> None:
        self.rng = random.Random(seed)  # noqa: S311 - test data, not secrets
        self.image: dict[str, bytearray] = {}
        self.model = Model()
        self.stats = Stats()
        self.factory = store_factory
        self.names = itertools.count(1)
        self.versions = itertools.count(1)
        self._setup()

    def _store(self, media: FaultyMedia) -> CowVolumeStore:
        return self.factory(media, KeySealer(MASTER_KEY), checkpoint_log_bytes=CHECKPOINT_LOG_BYTES)

    def _setup(self) -> None:
        media = FaultyMedia()
        store = self._store(media)
        try:
            for i, services in enumerate(SERVICES):
                bs = block_size_of(i)
                store.create(volume_name(i), BLOCKS * bs, bs, services)
                self.model.volumes[volume_name(i)] = VolumeModel(
                    volume_name(i), bs, BLOCKS, {}, [BLOCKS]
                )
        finally:
            store.close()
        self.image = media.image()

    # ------------------------------------------------------------ one cycle

    def cycle(self) -> None:
        """Open on the last image, work until the power goes, check what is left."""
        rng = self.rng
        keep = rng.choice(KEEP)
        tear = min(rng.choice(TEAR), 1 - keep)
        at_sync = rng.randint(1, 24) if rng.random() < 0.5 else None
        media = FaultyMedia(
            self.image,
            cut_after=rng.randint(1, 700),
            cut_at_sync=at_sync,
            keep=keep,
            tear=tear,
            rng=rng,
        )
        self.stats.cycles += 1
        try:
            store = self._store(media)
        except (AgentError, OSError):
            if not media.dead:
                raise
            self.stats.cut_while_opening += 1
            self._after_cut(media)
            return
        try:
            threads = [
                threading.Thread(target=self._writer, args=(store, media, k, rng.random()))
                for k in range(WRITERS)
            ]
            threads.append(threading.Thread(target=self._admin, args=(store, media, rng.random())))
            threads.append(threading.Thread(target=self._reader, args=(store, media, rng.random())))
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            media.cut_now()
        finally:
            _close(store)
        self._after_cut(media)

    def _after_cut(self, media: FaultyMedia) -> None:
        self.image = media.image()
        self.stats.sectors_torn += media.torn
        self.stats.sectors_kept += media.kept
        self.check()

    # ------------------------------------------------------------ the workload

    def _content(self, bs: int, rng: random.Random) -> bytes:
        tag = struct.pack("<Q", next(self.versions))
        kind = rng.randrange(3)
        if kind == 0:
            body = rng.randbytes(bs - 8)
        elif kind == 1:
            body = (b"the quick brown fox %d " % rng.randrange(100) * bs)[: bs - 8]
        else:
            body = bytes(bs - 8)
        return tag + body

    def _guard(self, media: FaultyMedia, what: str, call: Callable[[], object]) -> bool:
        """Run a store call; False if the power went (expected), a violation if it failed before."""
        try:
            call()
        except DataCorruption as exc:
            if not media.dead:
                self.stats.violations.append(f"{what}: DATA_LOSS before any cut: {exc}")
            return False
        except (AgentError, OSError) as exc:
            if not media.dead:
                self.stats.violations.append(f"{what}: failed before any cut: {exc!r}")
            return False
        return not media.dead

    def _writer(self, store: CowVolumeStore, media: FaultyMedia, k: int, seed: float) -> None:
        rng = random.Random(seed)  # noqa: S311 - test data, not secrets
        model = self.model
        share = BLOCKS // WRITERS
        for _ in range(OPS_PER_WRITER):
            if media.dead:
                return
            vol = model.volumes[rng.choice(self._live_volumes())]
            low = k * share
            if vol.snapshot:  # clones are the admin's
                continue
            op = rng.random()
            if op < 0.12:
                with model.lock:
                    started = model.tick()
                flush = functools.partial(store.flush, vol.name)
                if not self._guard(media, f"flush {vol.name}", flush):
                    return
                model.committed(vol.name, started)
                continue
            count = rng.randint(1, 4)
            first = rng.randrange(low, low + share - count + 1)
            if op < 0.22:
                self._trim(store, media, vol, first, count)
                continue
            self._write(store, media, vol, first, count, fua=rng.random() < 0.3, rng=rng)

    def _write(
        self,
        store: CowVolumeStore,
        media: FaultyMedia,
        vol: VolumeModel,
        first: int,
        count: int,
        *,
        fua: bool,
        rng: random.Random,
    ) -> bool:
        bs = vol.block_size
        contents = [self._content(bs, rng) for _ in range(count)]
        versions = [self.model.issue(vol.name, first + i, c) for i, c in enumerate(contents)]
        with self.model.lock:
            started = self.model.tick()
        data = b"".join(contents)
        call: Callable[[], object]
        if fua or rng.random() < 0.5:
            call = functools.partial(store.write, vol.name, first * bs, data, fua=fua)
        else:  # the data plane's path for small writes: one block per write, in one batch
            writes = [(vol.name, (first + i) * bs, c) for i, c in enumerate(contents)]
            call = functools.partial(_batch, store, writes)
        ok = self._guard(media, f"write {vol.name}@{first}+{count}", call)
        if ok:
            self.model.ack(versions, durable=fua)
            if fua:
                self.model.committed(vol.name, started)
        return ok

    def _trim(
        self, store: CowVolumeStore, media: FaultyMedia, vol: VolumeModel, first: int, count: int
    ) -> bool:
        bs = vol.block_size
        versions = [self.model.issue(vol.name, first + i, bytes(bs)) for i in range(count)]
        with self.model.lock:
            started = self.model.tick()
        ok = self._guard(
            media,
            f"trim {vol.name}@{first}+{count}",
            lambda: store.trim(vol.name, first * bs, count * bs),
        )
        if ok:
            self.model.ack(versions, durable=True)
            self.model.committed(vol.name, started)
        return ok

    def _reader(self, store: CowVolumeStore, media: FaultyMedia, seed: float) -> None:
        """Read while the others write: each block as a version current during the read."""
        rng = random.Random(seed)  # noqa: S311 - test data, not secrets
        model = self.model
        for _ in range(READS):
            with model.lock:
                volumes = [v for v in model.volumes.values() if v.created and not v.deleting]
                vol = rng.choice(volumes)
                count = rng.randint(1, 8)
                first = rng.randrange(0, BLOCKS - count + 1)
                started = model.tick()
            bs = vol.block_size
            got: list[bytes] = []
            read = functools.partial(self._read, store, vol, first, count, got)
            if not self._guard(media, f"read {vol.name}@{first}+{count}", read):
                return
            if not got:
                continue
            with model.lock:
                ended = model.tick()
                for i in range(count):
                    block = got[0][i * bs : (i + 1) * bs]
                    allowed = model.current(vol.name, first + i, started, ended)
                    if FROM_SNAPSHOT in allowed:
                        continue  # a clone's first version: its snapshot's (checked after)
                    if block not in allowed:
                        self.stats.violations.append(
                            self._describe(
                                "a read while writing", vol.name, first + i, block, allowed
                            )
                        )
                self.stats.reads_checked += count

    @staticmethod
    def _read(
        store: CowVolumeStore, vol: VolumeModel, first: int, count: int, got: list[bytes]
    ) -> None:
        bs = vol.block_size
        try:
            got.append(store.read(vol.name, first * bs, count * bs))
        except NotFound:
            if not vol.deleting:  # a clone the admin is deleting may go
                raise

    def _live_volumes(self) -> list[str]:
        with self.model.lock:
            return [v.name for v in self.model.volumes.values() if not v.deleting]

    def _admin(self, store: CowVolumeStore, media: FaultyMedia, seed: float) -> None:
        rng = random.Random(seed)  # noqa: S311 - test data, not secrets
        for _ in range(ADMIN_OPS):
            if media.dead:
                return
            op = rng.randrange(5)
            if op == 0:
                self._tail(store, media, rng)
            elif op == 1:
                self._snapshot(store, media, rng)
            elif op == 2:
                self._clone(store, media, rng)
            elif op == 3:
                self._write_clone(store, media, rng)
            else:
                self._delete(store, media, rng)

    def _tail(self, store: CowVolumeStore, media: FaultyMedia, rng: random.Random) -> None:
        """Grow a volume by TAIL blocks, write them, shrink it back (force)."""
        model = self.model
        vol = model.volumes[volume_name(rng.randrange(len(SERVICES)))]
        bs = vol.block_size
        with model.lock:
            vol.sizes.append(BLOCKS + TAIL)
            vol.blocks = BLOCKS + TAIL
        if not self._guard(
            media, f"grow {vol.name}", lambda: store.resize(vol.name, (BLOCKS + TAIL) * bs)
        ):
            return
        with model.lock:
            vol.sizes = [BLOCKS + TAIL]
        if not self._write(
            store, media, vol, BLOCKS, rng.randint(1, TAIL), fua=rng.random() < 0.5, rng=rng
        ):
            return
        versions = [model.issue(vol.name, BLOCKS + i, bytes(bs)) for i in range(TAIL)]
        with model.lock:
            vol.sizes.append(BLOCKS)
            vol.blocks = BLOCKS
            started = model.tick()
        if not self._guard(
            media,
            f"shrink {vol.name}",
            lambda: store.resize(vol.name, BLOCKS * bs, force=True),
        ):
            return
        model.ack(versions, durable=True)
        model.committed(vol.name, started)
        with model.lock:
            vol.sizes = [BLOCKS]

    def _snapshot(self, store: CowVolumeStore, media: FaultyMedia, rng: random.Random) -> None:
        model = self.model
        with model.lock:
            alive = [s for s in model.snapshots.values() if not s.deleting]
            if len(alive) >= MAX_SNAPSHOTS:
                return
            volumes = [v for v in model.volumes.values() if not v.deleting]
            vol = rng.choice(volumes)
            name = f"s{next(self.names)}"
            snap = SnapshotModel(name, vol.name, vol.block_size, vol.blocks, [], vol.snapshot)
            model.snapshots[name] = snap
            started = model.tick()
        if not self._guard(
            media, f"snapshot {vol.name}", lambda: store.create_snapshot(vol.name, name)
        ):
            self._snapshot_candidates(snap, vol, started)
            return
        self._snapshot_candidates(snap, vol, started)
        model.committed(vol.name, started)
        with model.lock:
            snap.created = True

    def _snapshot_candidates(self, snap: SnapshotModel, vol: VolumeModel, started: int) -> None:
        with self.model.lock:
            ended = self.model.tick()
            snap.candidates = [
                self.model.current(vol.name, b, started, ended) for b in range(snap.blocks)
            ]

    def _clone(self, store: CowVolumeStore, media: FaultyMedia, rng: random.Random) -> None:
        model = self.model
        with model.lock:
            clones = [v for v in model.volumes.values() if v.snapshot and not v.deleting]
            snaps = [s for s in model.snapshots.values() if s.created and not s.deleting]
            if len(clones) >= MAX_CLONES or not snaps:
                return
            snap = rng.choice(snaps)
            name = f"c{next(self.names)}"
            bs = snap.block_size
            history = {b: [Version(FROM_SNAPSHOT, 0, 0, True)] for b in range(snap.blocks)}
            clone = VolumeModel(name, bs, snap.blocks, history, [snap.blocks], snap.name, False)
            model.volumes[name] = clone
        if self._guard(media, f"clone {snap.name}", lambda: store.clone(snap.name, name)):
            with model.lock:
                clone.created = True

    def _write_clone(self, store: CowVolumeStore, media: FaultyMedia, rng: random.Random) -> None:
        with self.model.lock:
            clones = [v for v in self.model.volumes.values() if v.snapshot and v.created]
            clones = [v for v in clones if not v.deleting]
        if not clones:
            return
        vol = rng.choice(clones)
        count = rng.randint(1, 4)
        first = rng.randrange(0, vol.blocks - count + 1)
        self._write(store, media, vol, first, count, fua=rng.random() < 0.5, rng=rng)

    def _delete(self, store: CowVolumeStore, media: FaultyMedia, rng: random.Random) -> None:
        model = self.model
        with model.lock:
            clones = [v for v in model.volumes.values() if v.snapshot and v.created]
            clones = [v for v in clones if not v.deleting]
            busy = {v.snapshot for v in model.volumes.values() if v.snapshot and not v.deleted}
            busy |= {s.base for s in model.snapshots.values() if s.base and not s.deleted}
            snaps = [s for s in model.snapshots.values() if s.created and not s.deleting]
            snaps = [s for s in snaps if s.name not in busy]
            if clones and (not snaps or rng.random() < 0.5):
                vol = rng.choice(clones)
                vol.deleting = True
                target, call = vol.name, (lambda: store.delete(vol.name))
            elif snaps:
                snap = rng.choice(snaps)
                snap.deleting = True
                target, call = snap.name, (lambda: store.delete_snapshot(snap.name))
            else:
                return
        if self._guard(media, f"delete {target}", call):
            with model.lock:
                if target in model.volumes:
                    model.volumes[target].deleted = True
                else:
                    model.snapshots[target].deleted = True

    # ------------------------------------------------------------ the check

    def check(self) -> None:
        """Open the image with a fresh store and hold it against the model; then re-base."""
        media = FaultyMedia(self.image)
        where = f"cut {self.stats.cycles}"
        try:
            store = self._store(media)
        except AgentError as exc:
            self.stats.violations.append(f"{where}: the store does not open: {exc!r}")
            raise AssertionError(self.stats.violations[-1]) from exc
        try:
            self._check_snapshots(store, where)
            self._check_volumes(store, where)
        finally:
            _close(store)

    def _check_volumes(self, store: CowVolumeStore, where: str) -> None:
        model = self.model
        present = {info.volume_id: info for info in store.list()}
        for name, vol in list(model.volumes.items()):
            exists = name in present
            if exists and vol.deleted:
                self.stats.violations.append(f"{where}: deleted volume {name} is back")
            if not exists:
                if vol.created and not vol.deleting:
                    self.stats.violations.append(f"{where}: volume {name} is gone")
                del model.volumes[name]
                continue
            size = present[name].size_bytes // vol.block_size
            if size not in vol.sizes:
                self.stats.violations.append(f"{where}: {name} has {size} blocks, not {vol.sizes}")
            try:
                data = store.read(name, 0, size * vol.block_size)
            except DataCorruption as exc:
                self.stats.violations.append(f"{where}: {name} reads DATA_LOSS: {exc}")
                data = None
            base: dict[int, list[Version]] = {}
            for b in range(size):
                bs = vol.block_size
                got = None if data is None else data[b * bs : (b + 1) * bs]
                allowed = self._resolve(vol, model.allowed(name, b), b)
                if got is not None and got not in allowed:
                    self.stats.violations.append(self._describe(where, name, b, got, allowed))
                self.stats.blocks_checked += 1
                base[b] = [Version(got if got is not None else bytes(bs), 0, 0, True)]
            vol.history, vol.sizes, vol.blocks = base, [size], size
            vol.created, vol.deleting, vol.deleted = True, False, False

    def _check_snapshots(self, store: CowVolumeStore, where: str) -> None:
        model = self.model
        present = {s.snapshot_id: s for s in store.list_snapshots()}
        self.actual: dict[str, bytes] = {}
        for name, snap in list(model.snapshots.items()):
            exists = name in present
            if exists and snap.deleted:
                self.stats.violations.append(f"{where}: deleted snapshot {name} is back")
            if not exists:
                if snap.created and not snap.deleting:
                    self.stats.violations.append(f"{where}: snapshot {name} is gone")
                del model.snapshots[name]
                continue
            probe = f"probe-{next(self.names)}"
            store.clone(name, probe)
            vol = model.volumes.get(snap.volume)
            bs = present[name].block_size
            try:
                data = store.read(probe, 0, snap.blocks * bs)
            except DataCorruption as exc:
                self.stats.violations.append(f"{where}: snapshot {name} reads DATA_LOSS: {exc}")
                data = bytes(snap.blocks * bs)
            store.delete(probe)
            self.actual[name] = data
            for b in range(snap.blocks):
                got = data[b * bs : (b + 1) * bs]
                allowed = snap.candidates[b] if b < len(snap.candidates) else []
                if vol is not None:
                    allowed = self._resolve(vol, allowed, b)
                if got not in allowed:
                    self.stats.violations.append(
                        self._describe(f"{where}: snapshot", name, b, got, allowed)
                    )
            snap.candidates = [[data[b * bs : (b + 1) * bs]] for b in range(snap.blocks)]
            snap.created, snap.deleting, snap.deleted = True, False, False
            self.stats.snapshots_checked += 1

    def _resolve(self, vol: VolumeModel, allowed: list[bytes], block: int) -> list[bytes]:
        """FROM_SNAPSHOT -> what the clone's snapshot actually holds."""
        if FROM_SNAPSHOT not in allowed:
            return allowed
        found = [c for c in allowed if c != FROM_SNAPSHOT]
        data = self.actual.get(vol.snapshot)
        if data is not None:
            bs = vol.block_size
            found.append(
                data[block * bs : (block + 1) * bs] if (block + 1) * bs <= len(data) else bytes(bs)
            )
        return found

    @staticmethod
    def _describe(where: str, name: str, block: int, got: bytes, allowed: list[bytes]) -> str:
        tags = [c[:8].hex() for c in allowed]
        what = f"{where}: {name} block {block} reads {got[:8].hex()}..., allowed {tags}"
        for content in allowed:
            if content[:8] == got[:8]:  # the right version, but not all of it: torn
                bad = [
                    i for i in range(0, len(got), 512) if got[i : i + 512] != content[i : i + 512]
                ]
                what += f" (a mix: sectors at {bad} differ from that version)"
        return what

    def finish(self) -> Stats:
        """The totals."""
        self.stats.acked_writes = self.model.acked_writes
        self.stats.durable_writes = self.model.durable_writes
        return self.stats


def _close(store: CowVolumeStore) -> None:
    with contextlib.suppress(AgentError, OSError):  # the power is gone: closing cannot write
        store.close()


def run(
    cycles: int, seed: int | None = None, *, until_violation: bool = False, **kwargs: object
) -> Stats:
    """`cycles` power cuts on one store (or fewer: to the first violation); what happened."""
    seed = int.from_bytes(os.urandom(4)) if seed is None else seed
    torture = Torture(seed, **kwargs)  # type: ignore[arg-type]
    for _ in range(cycles):
        torture.cycle()
        if until_violation and torture.stats.violations:
            break
    stats = torture.finish()
    if stats.violations:
        stats.violations.insert(0, f"seed {seed}")
    return stats

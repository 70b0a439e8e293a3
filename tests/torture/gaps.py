"""Power-cut torture of what workload.py does not reach (the audit's gaps).

Same media (faulty_media.py), same check (workload.Torture.check), a different
workload:

- multi-block writes of 16-300 blocks (64 KiB to 1.2 MiB at 4 KiB; their records span
  several log blocks, and their data several vectored writes);
- a racer thread that trims and overwrites ranges the writers are writing (two ops on
  one block at once: a block may then read as either, so the model is looser, below);
- an admin that shrinks a volume into the writers' ranges while they write, then
  grows it back; and creates a volume, writes it, snapshots it, clones the snapshot,
  deletes the volume while the clone lives, then the clone, then the snapshot;
- the pool file's size and the space the store counts as used, after every cut, to
  see whether they grow without bound.

The model: a block may read as any version that is not older than a durable one
(older: acknowledged before that durable version was issued), so two ops racing on a
block may leave either. A write that failed (shrunk under it) is dropped from it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import threading
from typing import Final

from dpu_agent.errors import AgentError, InvalidArgument
from dpu_agent.storage import Compression, DataServices, Encryption
from dpu_agent.storage.engine import CowVolumeStore
from tests.torture import workload
from tests.torture.faulty_media import FaultyMedia
from tests.torture.model import FROM_SNAPSHOT, Model, SnapshotModel, Version, VolumeModel

SERVICES: Final = [
    DataServices(False, Compression.NONE, Encryption.NONE),
    DataServices(True, Compression.LZ4, Encryption.NONE),
    DataServices(True, Compression.NONE, Encryption.AES_XTS_256),
    DataServices(True, Compression.ZSTD, Encryption.AES_XTS_256),
]
BLOCKS: Final = 640
WRITERS: Final = 2
SIZES: Final = (16, 32, 64, 128, 256, 300)
OPS_PER_WRITER: Final = 6
RACER_OPS: Final = 8


def _older(v: Version, w: Version) -> bool:
    """v was acknowledged before w was issued (so w supersedes v)."""
    return v.acked is not None and w.issued > v.acked


class LooseModel(Model):
    """Model, with racing ops on a block allowed to land in either order."""

    def allowed(self, volume: str, block: int) -> list[bytes]:
        vol = self.volumes[volume]
        history = vol.history.get(block, [])
        durable = [w for w in history if w.durable]
        zero = Version(bytes(vol.block_size), 0, 0, durable=True)
        found = [v.content for v in [zero, *history] if not any(_older(v, w) for w in durable)]
        return found or [history[-1].content]

    def current(self, volume: str, block: int, started: int, ended: int) -> list[bytes]:
        vol = self.volumes[volume]
        history = vol.history.get(block, [])
        zero = Version(bytes(vol.block_size), 0, 0, durable=True)
        done = [zero, *(v for v in history if v.acked is not None and v.acked < started)]
        found = [v.content for v in done if not any(_older(v, w) for w in done)]
        found += [
            v.content
            for v in history
            if v.issued < ended and (v.acked is None or v.acked > started)
        ]
        return found

    def forget(self, volume: str, versions: list[Version]) -> None:
        """These versions' write failed: they never happened."""
        with self.lock:
            vol = self.volumes[volume]
            for v in versions:
                for history in vol.history.values():
                    if v in history:
                        history.remove(v)


@dataclasses.dataclass
class Growth:
    """Pool file size and used bytes after each cut."""

    pool_bytes: list[int] = dataclasses.field(default_factory=list)
    used_bytes: list[int] = dataclasses.field(default_factory=list)
    live_bytes: list[int] = dataclasses.field(default_factory=list)


class GapTorture(workload.Torture):
    """workload.Torture with the workload of the module doc."""

    def __init__(self, seed: int, **kwargs: object) -> None:
        self.growth = Growth()
        self.extra = 0
        super().__init__(seed, **kwargs)  # type: ignore[arg-type]
        self.loose = _rebuilt(self.model)
        self.model = self.loose

    def _setup(self) -> None:
        media = FaultyMedia()
        store = self._store(media)
        try:
            for i, services in enumerate(SERVICES):
                bs = workload.block_size_of(i)
                store.create(f"v{i}", BLOCKS * bs, bs, services)
                self.model.volumes[f"v{i}"] = VolumeModel(f"v{i}", bs, BLOCKS, {}, [BLOCKS])
        finally:
            store.close()
        self.image = media.image()

    def cycle(self) -> None:
        rng = self.rng
        keep = rng.choice(workload.KEEP)
        tear = min(rng.choice(workload.TEAR), 1 - keep)
        at_sync = rng.randint(1, 40) if rng.random() < 0.5 else None
        media = FaultyMedia(
            self.image,
            cut_after=rng.randint(1, 2500),
            cut_at_sync=at_sync,
            keep=keep,
            tear=tear,
            rng=rng,
        )
        self.stats.cycles += 1
        try:
            store = self._store(media)
        except (AgentError, OSError):
            if not _dead(media):
                raise
            self.stats.cut_while_opening += 1
            self._after_cut(media)
            return
        try:
            threads = [
                threading.Thread(target=self._big_writer, args=(store, media, k, rng.random()))
                for k in range(WRITERS)
            ]
            threads.append(threading.Thread(target=self._racer, args=(store, media, rng.random())))
            threads.append(
                threading.Thread(target=self._gap_admin, args=(store, media, rng.random()))
            )
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            media.cut_now()
        finally:
            workload._close(store)
        self._after_cut(media)

    def check(self) -> None:
        super().check()
        pool = self.image.get("pool", bytearray())
        self.growth.pool_bytes.append(len(pool))
        media = FaultyMedia(self.image)
        store = self._store(media)
        try:
            self.growth.used_bytes.append(store._space.used_bytes())
            live = 0
            for node in store._state.nodes.values():
                live += node.map.allocated * node.block_size
            self.growth.live_bytes.append(live)
        finally:
            workload._close(store)

    # ------------------------------------------------------------ the workload

    def _volumes(self) -> list[VolumeModel]:
        with self.model.lock:
            return [v for v in self.model.volumes.values() if v.name.startswith("v")]

    def _big_writer(self, store: CowVolumeStore, media: FaultyMedia, k: int, seed: float) -> None:
        rng = random.Random(seed)  # noqa: S311 - test data, not secrets
        share = BLOCKS // WRITERS
        for _ in range(OPS_PER_WRITER):
            if _dead(media):
                return
            vol = rng.choice(self._volumes())
            count = rng.choice(SIZES)
            first = k * share + rng.randrange(0, share - count + 1)
            op = rng.random()
            if op < 0.15:
                with self.model.lock:
                    started = self.model.tick()
                if not self._guard(
                    media, f"flush {vol.name}", functools.partial(store.flush, vol.name)
                ):
                    return
                self.model.committed(vol.name, started)
                continue
            if not self._racy_write(
                store, media, vol, first, count, fua=rng.random() < 0.4, rng=rng
            ):
                return

    def _racy_write(
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
        """A write that may fail for a shrink under it (then it never happened)."""
        bs = vol.block_size
        contents = [self._content(bs, rng) for _ in range(count)]
        versions = [self.model.issue(vol.name, first + i, c) for i, c in enumerate(contents)]
        with self.model.lock:
            started = self.model.tick()
        try:
            store.write(vol.name, first * bs, b"".join(contents), fua=fua)
        except InvalidArgument:
            if _dead(media):
                return False
            self.loose.forget(vol.name, versions)  # shrunk under it (or before it)
            return True
        except (AgentError, OSError) as exc:
            if not _dead(media):
                self.stats.violations.append(f"write {vol.name}: failed before any cut: {exc!r}")
            return False
        if _dead(media):
            return False
        self.model.ack(versions, durable=fua)
        if fua:
            self.model.committed(vol.name, started)
        return True

    def _racer(self, store: CowVolumeStore, media: FaultyMedia, seed: float) -> None:
        """Trims and small overwrites anywhere: racing the writers on their blocks."""
        rng = random.Random(seed)  # noqa: S311 - test data, not secrets
        for _ in range(RACER_OPS):
            if _dead(media):
                return
            vol = rng.choice(self._volumes())
            count = rng.randint(1, 64)
            first = rng.randrange(0, BLOCKS - count + 1)
            if rng.random() < 0.5:
                bs = vol.block_size
                versions = [self.model.issue(vol.name, first + i, bytes(bs)) for i in range(count)]
                with self.model.lock:
                    started = self.model.tick()
                try:
                    store.trim(vol.name, first * bs, count * bs)
                except InvalidArgument:
                    if _dead(media):
                        return
                    self.loose.forget(vol.name, versions)
                    continue
                except (AgentError, OSError) as exc:
                    if not _dead(media):
                        self.stats.violations.append(f"trim {vol.name}: failed: {exc!r}")
                    return
                if _dead(media):
                    return
                self.model.ack(versions, durable=True)
                self.model.committed(vol.name, started)
            elif not self._racy_write(
                store, media, vol, first, count, fua=rng.random() < 0.5, rng=rng
            ):
                return

    def _gap_admin(self, store: CowVolumeStore, media: FaultyMedia, seed: float) -> None:
        rng = random.Random(seed)  # noqa: S311 - test data, not secrets
        if not self._cleanup(store, media):
            return
        if rng.random() < 0.5:
            self._shrink_under_writes(store, media, rng)
        else:
            self._delete_with_clone(store, media, rng)

    def _cleanup(self, store: CowVolumeStore, media: FaultyMedia) -> bool:
        """Delete what an earlier cycle's delete_with_clone left (clones, volumes, snapshots)."""
        model = self.model
        with model.lock:
            left = [v.name for v in model.volumes.values() if v.name.startswith("xc")]
            left += [
                v.name
                for v in model.volumes.values()
                if v.name.startswith("x") and v.name not in left
            ]
            snaps = [s.name for s in model.snapshots.values() if s.name.startswith("xs")]
        for name in left:
            with model.lock:
                model.volumes[name].deleting = True
            if not self._guard(media, f"delete {name}", functools.partial(store.delete, name)):
                return False
            with model.lock:
                model.volumes[name].deleted = True
        for name in snaps:
            with model.lock:
                model.snapshots[name].deleting = True
            if not self._guard(
                media, f"delete {name}", functools.partial(store.delete_snapshot, name)
            ):
                return False
            with model.lock:
                model.snapshots[name].deleted = True
        return True

    def _shrink_under_writes(
        self, store: CowVolumeStore, media: FaultyMedia, rng: random.Random
    ) -> None:
        model = self.model
        vol = rng.choice(self._volumes())
        bs = vol.block_size
        keep = rng.randrange(BLOCKS // 4, BLOCKS)
        with model.lock:
            started = model.tick()
            vol.sizes = sorted({*vol.sizes, keep})
        versions = [model.issue(vol.name, b, bytes(bs)) for b in range(keep, BLOCKS)]
        with model.lock:
            started = model.tick()
        if not self._guard(
            media,
            f"shrink {vol.name} to {keep}",
            lambda: store.resize(vol.name, keep * bs, force=True),
        ):
            return
        model.ack(versions, durable=True)
        model.committed(vol.name, started)
        with model.lock:
            vol.sizes = [keep, BLOCKS]
        if not self._guard(media, f"grow {vol.name}", lambda: store.resize(vol.name, BLOCKS * bs)):
            return
        with model.lock:
            vol.sizes = [BLOCKS]

    def _delete_with_clone(
        self, store: CowVolumeStore, media: FaultyMedia, rng: random.Random
    ) -> None:
        model = self.model
        self.extra += 1
        name, snap_name, clone_name = f"x{self.extra}", f"xs{self.extra}", f"xc{self.extra}"
        bs = 4096
        blocks = 64
        services = rng.choice(SERVICES)
        with model.lock:
            vol = VolumeModel(name, bs, blocks, {}, [blocks], created=False)
            model.volumes[name] = vol
        if not self._guard(
            media, f"create {name}", lambda: store.create(name, blocks * bs, bs, services)
        ):
            return
        with model.lock:
            vol.created = True
        if not self._racy_write(store, media, vol, 0, blocks, fua=rng.random() < 0.5, rng=rng):
            return
        with model.lock:
            snap = SnapshotModel(snap_name, name, bs, blocks, [])
            model.snapshots[snap_name] = snap
            started = model.tick()
        if not self._guard(
            media, f"snapshot {name}", lambda: store.create_snapshot(name, snap_name)
        ):
            self._snapshot_candidates(snap, vol, started)
            return
        self._snapshot_candidates(snap, vol, started)
        model.committed(name, started)
        with model.lock:
            snap.created = True
            history = {b: [Version(FROM_SNAPSHOT, 0, 0, True)] for b in range(blocks)}
            clone = VolumeModel(clone_name, bs, blocks, history, [blocks], snap_name, False)
            model.volumes[clone_name] = clone
        if not self._guard(media, f"clone {snap_name}", lambda: store.clone(snap_name, clone_name)):
            return
        with model.lock:
            clone.created = True
        if not self._racy_write(store, media, clone, rng.randrange(0, 32), 32, fua=False, rng=rng):
            return
        for target, kind in ((name, "volume"), (clone_name, "volume"), (snap_name, "snapshot")):
            with model.lock:
                if kind == "volume":
                    model.volumes[target].deleting = True
                    call = functools.partial(store.delete, target)
                else:
                    model.snapshots[target].deleting = True
                    call = functools.partial(store.delete_snapshot, target)
            if not self._guard(media, f"delete {kind} {target}", call):
                return
            with model.lock:
                if kind == "volume":
                    model.volumes[target].deleted = True
                else:
                    model.snapshots[target].deleted = True


def _dead(media: FaultyMedia) -> bool:
    """The power is gone (a call, so that type checkers do not narrow it)."""
    return media.dead


def _rebuilt(model: Model) -> LooseModel:
    loose = LooseModel()
    loose.volumes = model.volumes
    loose.snapshots = model.snapshots
    return loose


def run(cycles: int, seed: int | None = None) -> tuple[workload.Stats, Growth, int]:
    seed = int.from_bytes(os.urandom(4)) if seed is None else seed
    torture = GapTorture(seed)
    for _ in range(cycles):
        torture.cycle()
    stats = torture.finish()
    if stats.violations:
        stats.violations.insert(0, f"seed {seed}")
    return stats, torture.growth, seed

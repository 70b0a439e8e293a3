"""What a crash may leave of each block, volume and snapshot: the checker's model.

Every write, trim or shrink of a block is a `Version` with its content, when it was
issued and when it was acknowledged (on a global counter), and whether it is known
durable: FUA, or acknowledged before a later commit of the same volume (flush, FUA
write, trim, resize, snapshot) started and that commit returned before the power
went. Ops on one block are sequential in the workload (each block has one writer),
so after a crash a block must read as:

- its last durable version, or any version issued after it (in flight, or
  acknowledged without durability), whole;
- never DATA_LOSS, never anything else (a torn mix, a version older than the last
  durable one, garbage).

A snapshot must read, for each block, as the version current when it was taken:
the last one acknowledged before the snapshot started, or one in flight while it
ran. A clone's untouched blocks read as its snapshot does.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading

FROM_SNAPSHOT = b"<the clone's snapshot>"  # content marker of a clone's first versions


@dataclasses.dataclass(eq=False)
class Version:
    """One write (or trim, or shrink) of one block."""

    content: bytes
    issued: int
    acked: int | None = None
    durable: bool = False


@dataclasses.dataclass
class SnapshotModel:
    """A snapshot and what each block of it may read as."""

    name: str
    volume: str
    block_size: int
    blocks: int
    candidates: list[list[bytes]]
    base: str = ""  # a snapshot of a clone: the clone's snapshot (which it keeps busy)
    created: bool = False  # acknowledged
    deleting: bool = False  # a delete was issued
    deleted: bool = False  # acknowledged


@dataclasses.dataclass
class VolumeModel:
    """A volume: its block histories and sizes."""

    name: str
    block_size: int
    blocks: int  # current size in blocks (the last one asked for)
    history: dict[int, list[Version]]
    sizes: list[int]  # sizes it may have after a crash (in blocks)
    snapshot: str = ""  # a clone: its snapshot
    created: bool = True
    deleting: bool = False
    deleted: bool = False


class Model:
    """Everything the workload did, under one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._clock = itertools.count(1)
        self.volumes: dict[str, VolumeModel] = {}
        self.snapshots: dict[str, SnapshotModel] = {}
        self.acked_writes = 0
        self.durable_writes = 0

    def tick(self) -> int:
        """The next point on the global counter (call under the lock)."""
        return next(self._clock)

    def issue(self, volume: str, block: int, content: bytes) -> Version:
        """A new version of a block, about to be written."""
        with self.lock:
            version = Version(content, self.tick())
            self.volumes[volume].history.setdefault(block, []).append(version)
            return version

    def ack(self, versions: list[Version], *, durable: bool) -> None:
        """The op that wrote these versions returned OK before the power went."""
        with self.lock:
            now = self.tick()
            for version in versions:
                version.acked = now
                version.durable = version.durable or durable
            self.acked_writes += len(versions)

    def committed(self, volume: str, started: int) -> None:
        """A commit of `volume` that started at `started` returned OK before the power went."""
        with self.lock:
            for history in self.volumes[volume].history.values():
                for version in history:
                    if version.acked is not None and version.acked < started:
                        if not version.durable:
                            self.durable_writes += 1
                        version.durable = True

    def allowed(self, volume: str, block: int) -> list[bytes]:
        """What the block may read as after a crash now."""
        history = self.volumes[volume].history.get(block, [])
        last = max((i for i, v in enumerate(history) if v.durable), default=-1)
        found = [v.content for v in history[max(last, 0) :]]
        if last < 0:
            found.insert(0, bytes(self.volumes[volume].block_size))
        return found

    def current(self, volume: str, block: int, started: int, ended: int) -> list[bytes]:
        """What a snapshot taken between `started` and `ended` may hold for the block."""
        history = self.volumes[volume].history.get(block, [])
        done = [v for v in history if v.acked is not None and v.acked < started]
        found = [done[-1].content] if done else [bytes(self.volumes[volume].block_size)]
        found += [
            v.content
            for v in history
            if v.issued < ended and (v.acked is None or v.acked > started) and v not in done
        ]
        return found

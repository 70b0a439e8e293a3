"""A store media that loses power: writes sit in a volatile cache until sync.

`FaultyMedia` implements `dpu_agent.storage.media.StoreMedia` in RAM like a disk
with a write cache and no power-loss protection:

- `pwrite` and `discard` change what reads return at once, and queue the change in
  the file's volatile cache;
- `sync` of a file moves everything queued for that file to stable storage;
- a power cut (at the `cut_after`-th media operation, counted over every file, or
  at the `cut_at_sync`-th sync, just before it: whichever comes first) decides the
  fate of every change still queued: it survives whole (probability `keep`), is
  torn (`tear`: each of its aligned 512-byte sectors survives or not, at random),
  or is lost; in any order, so a later write may survive while an earlier one does
  not. What stable storage holds at that instant is the image a restart sees
  (`image()`); every media call from then on fails with EIO, so the store that was
  running stops there, as it would without power.

One lock orders everything, so "before the cut" is well defined: an operation
that returned before the cut happened before it.
"""

from __future__ import annotations

import errno
import random
import threading
from typing import TYPE_CHECKING, Final

from dpu_agent.storage.media import StoreFile, StoreMedia

if TYPE_CHECKING:
    from collections.abc import Sequence

SECTOR: Final = 512


class PowerCut(OSError):
    """What every media call raises once the power is gone."""

    def __init__(self) -> None:
        super().__init__(errno.EIO, "the power is gone (simulated)")


class FaultyFile(StoreFile):
    """One file: what reads see, what is stable, and the volatile queue between."""

    def __init__(self, media: FaultyMedia, stable: bytearray) -> None:
        self._media = media
        self.stable = stable
        self.current = bytearray(stable)
        self.queued: list[tuple[int, bytes]] = []

    def pread(self, length: int, offset: int) -> bytes:
        with self._media.op():
            got = bytes(self.current[offset : offset + length])
        return got + bytes(length - len(got))

    def pwrite(self, data: bytes | bytearray | memoryview, offset: int) -> None:
        raw = bytes(data)
        with self._media.op():
            _put(self.current, offset, raw)
            self.queued.append((offset, raw))

    def pwritev(self, buffers: Sequence[bytes | bytearray | memoryview], offset: int) -> None:
        self.pwrite(b"".join(bytes(b) for b in buffers), offset)

    def sync(self) -> None:
        with self._media.op(sync=True):
            for offset, raw in self.queued:
                _put(self.stable, offset, raw)
            self.queued.clear()

    def discard(self, offset: int, length: int) -> None:
        self.pwrite(bytes(length), offset)

    def data_ranges(self) -> list[tuple[int, int]]:
        with self._media.op():
            return [(0, len(self.current))] if self.current else []

    def size(self) -> int:
        with self._media.op():
            return len(self.current)

    def close(self) -> None:
        """Nothing to release."""


def _put(target: bytearray, offset: int, raw: bytes) -> None:
    end = offset + len(raw)
    if len(target) < end:
        target.extend(bytes(end - len(target)))
    target[offset:end] = raw


class FaultyMedia(StoreMedia):
    """Files with a volatile write cache, and a power cut after `cut_after` operations."""

    def __init__(
        self,
        files: dict[str, bytearray] | None = None,
        *,
        cut_after: int | None = None,
        cut_at_sync: int | None = None,
        keep: float = 0.5,
        tear: float = 0.3,
        rng: random.Random | None = None,
    ) -> None:
        self.lock = threading.Lock()
        self.files = {
            name: FaultyFile(self, bytearray(data)) for name, data in (files or {}).items()
        }
        self.ops = 0
        self.cut_after = cut_after
        self.cut_at_sync = cut_at_sync
        self.syncs = 0
        self.keep = keep
        self.tear = tear
        self.rng = rng or random.Random(0)  # noqa: S311 - test data, not secrets
        self.dead = False
        self.torn = 0  # queued sectors the cut dropped
        self.kept = 0  # queued sectors the cut kept
        self._image: dict[str, bytearray] | None = None

    # every file operation goes through here, under the one lock
    def op(self, *, sync: bool = False) -> _Op:
        return _Op(self, sync=sync)

    def _tick(self, *, sync: bool) -> None:
        if self.dead:
            raise PowerCut
        self.ops += 1
        self.syncs += sync
        if (self.cut_after is not None and self.ops >= self.cut_after) or (
            sync and self.cut_at_sync is not None and self.syncs >= self.cut_at_sync
        ):
            self._cut()
            raise PowerCut

    def cut_now(self) -> None:
        """Cut the power now (if it is still on)."""
        with self.lock:
            if not self.dead:
                self._cut()

    def _cut(self) -> None:
        image = {}
        rng = self.rng
        for name, f in self.files.items():
            stable = bytearray(f.stable)
            pieces = []
            for offset, raw in f.queued:
                fate = rng.random()
                whole = fate < self.keep
                torn = not whole and fate < self.keep + self.tear
                at = offset
                while at < offset + len(raw):
                    end = min((at // SECTOR + 1) * SECTOR, offset + len(raw))
                    kept = whole or (torn and rng.random() < 0.5)
                    pieces.append((at, raw[at - offset : end - offset], kept))
                    at = end
            rng.shuffle(pieces)
            for at, piece, kept in pieces:
                if kept:
                    _put(stable, at, piece)
                    self.kept += 1
                else:
                    self.torn += 1
            image[name] = stable
        self._image = image
        self.dead = True

    def image(self) -> dict[str, bytearray]:
        """What stable storage held when the power went (cut first if needed)."""
        self.cut_now()
        assert self._image is not None
        return self._image

    def open(self, name: str) -> FaultyFile:
        with self.op():
            found = self.files.get(name)
            if found is None:
                found = self.files[name] = FaultyFile(self, bytearray())
            return found

    def exists(self, name: str) -> bool:
        with self.op():
            return name in self.files

    def remove(self, name: str) -> None:
        with self.op():
            self.files.pop(name, None)

    def free_bytes(self) -> int:
        return 1 << 40


class _Op:
    __slots__ = ("_media", "_sync")

    def __init__(self, media: FaultyMedia, *, sync: bool) -> None:
        self._media = media
        self._sync = sync

    def __enter__(self) -> None:
        self._media.lock.acquire()
        try:
            self._media._tick(sync=self._sync)
        except BaseException:
            self._media.lock.release()
            raise

    def __exit__(self, *exc: object) -> None:
        self._media.lock.release()

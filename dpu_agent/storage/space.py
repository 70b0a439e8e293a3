"""Free space of the pool, and when freed space may be used again.

Units: the pool is addressed in 512-byte sectors and handed out in 4 KiB chunks (a
4096-byte block, a log block) or single sectors of chunks kept for 512-byte blocks.
Chunks below `hwm` have been handed out at least once; free ones are kept in two
heaps (lowest first, so the pool stays compact): `backed` (they hold file space, so
writing them needs no allocation in the file system: the log's blocks come from
here) and `holes` (discarded, or never written).

A block that a change frees is not free at once. It goes to limbo with an epoch,
and comes out only when the change is durable (the journal calls `retire` after
its sync) and no read that might still use it is running: a read registers the
epoch at which it looked its blocks up (`reader_enter`), and a block retired at
epoch r is reused only once every running read entered at r or later. A chunk that
comes out of limbo to be discarded (given back to the file system) stays taken until
the caller has discarded it and says so (`discarded`): the discard runs without the
engine's lock, and a write given the chunk meanwhile would see its data zeroed.

Not thread-safe: the engine calls it under its lock.
"""

from __future__ import annotations

import collections
import heapq
from typing import TYPE_CHECKING

from dpu_agent.storage.layout import CHUNK, FIRST_DATA_CHUNK, SECTOR, SECTORS_PER_CHUNK

if TYPE_CHECKING:
    from collections.abc import Iterable

    from dpu_agent.storage.state import Free

Range = tuple[int, int]  # (byte offset, length) in the pool


class SpaceMap:
    """Which chunks and sectors of the pool are free; the limbo of freed ones."""

    def __init__(self) -> None:
        self.hwm = FIRST_DATA_CHUNK
        self._backed: list[int] = []
        self._holes: list[int] = []
        self._small_free: set[int] = set()
        self._small_used: dict[int, int] = {}  # chunk of small blocks -> sectors in use
        self._discarding: set[int] = set()  # out of limbo, not yet discarded (still taken)
        self._pinned: set[int] = set()  # sectors never freed until the store reopens
        self.used_chunks = 0  # whole chunks in use, small-block chunks included
        self._epoch = 0
        self._limbo: collections.deque[tuple[int, list[Free]]] = collections.deque()
        self._readers: collections.Counter[int] = collections.Counter()

    # ------------------------------------------------------------ allocation

    def _take_chunk(self) -> int:
        if self._backed:
            chunk = heapq.heappop(self._backed)
        elif self._holes:
            chunk = heapq.heappop(self._holes)
        else:
            chunk = self.hwm
            self.hwm += 1
        self.used_chunks += 1
        return chunk

    def alloc(self, count: int, block_size: int) -> list[int]:
        """Sectors for `count` new blocks of `block_size` bytes."""
        if block_size == CHUNK:
            return [self._take_chunk() * SECTORS_PER_CHUNK for _ in range(count)]
        out = []
        for _ in range(count):
            if not self._small_free:
                chunk = self._take_chunk()
                self._small_used[chunk] = 0
                base = chunk * SECTORS_PER_CHUNK
                self._small_free.update(range(base, base + SECTORS_PER_CHUNK))
            sector = self._small_free.pop()
            self._small_used[sector // SECTORS_PER_CHUNK] += 1
            out.append(sector)
        return out

    def take_backed(self) -> int | None:
        """A free chunk that holds file space (its sector), or None."""
        if not self._backed:
            return None
        self.used_chunks += 1
        return heapq.heappop(self._backed) * SECTORS_PER_CHUNK

    def take_fresh(self) -> int:
        """A free chunk that may need file space to be written (its sector)."""
        if self._holes:
            chunk = heapq.heappop(self._holes)
        else:
            chunk = self.hwm
            self.hwm += 1
        self.used_chunks += 1
        return chunk * SECTORS_PER_CHUNK

    def take_holes(self, count: int) -> list[int]:
        """Up to `count` free chunks without file space, lowest first (their sectors)."""
        taken = [heapq.heappop(self._holes) for _ in range(min(count, len(self._holes)))]
        self.used_chunks += len(taken)
        return [chunk * SECTORS_PER_CHUNK for chunk in taken]

    def take_fresh_run(self, count: int) -> list[int]:
        """`count` adjacent chunks past the end of the pool (their sectors)."""
        first = self.hwm
        self.hwm += count
        self.used_chunks += count
        return [(first + i) * SECTORS_PER_CHUNK for i in range(count)]

    def release(self, sectors: Iterable[int], block_size: int, *, backed: bool) -> None:
        """Give back blocks that no record ever pointed to (free at once)."""
        for sector in sectors:
            self._free(sector, block_size, backed=backed)

    def _free(
        self, sector: int, block_size: int, *, backed: bool = True, discard: bool = False
    ) -> Range | None:
        """Free one block; returns the range of a chunk to discard, if any.

        With `discard`, a chunk the block empties stays taken: its range is returned, to
        be discarded and then given to `discarded`.
        """
        if sector in self._pinned:
            return None  # kept taken (see `pin`)
        chunk = sector // SECTORS_PER_CHUNK
        if block_size != CHUNK:
            self._small_free.add(sector)
            self._small_used[chunk] -= 1
            if self._small_used[chunk]:
                return None
            del self._small_used[chunk]
            base = chunk * SECTORS_PER_CHUNK
            self._small_free.difference_update(range(base, base + SECTORS_PER_CHUNK))
        if discard:
            self._discarding.add(chunk)
            return (chunk * CHUNK, CHUNK)
        self._put_chunk(chunk, backed=backed)
        return None

    def _put_chunk(self, chunk: int, *, backed: bool) -> None:
        self.used_chunks -= 1
        heapq.heappush(self._backed if backed else self._holes, chunk)

    def discarded(self, ranges: Iterable[Range], *, backed: bool = False) -> None:
        """The chunks of ranges `reclaim` returned are discarded: free for the next write.

        `backed`: the discard failed, so they still hold file space.
        """
        for offset, length in ranges:
            for chunk in range(offset // CHUNK, (offset + length) // CHUNK):
                self._discarding.remove(chunk)
                self._put_chunk(chunk, backed=backed)

    def pin(self, sectors: Iterable[int]) -> None:
        """Never free these (taken) blocks again, whatever frees them, until the store reopens.

        Recovery's pins: see `CowVolumeStore._apply_commit`.
        """
        self._pinned.update(sectors)

    # ------------------------------------------------------------ limbo

    def retire(self, frees: list[Free]) -> None:
        """Blocks a now-durable change freed: free once no running read may use them."""
        if frees:
            self._epoch += 1
            self._limbo.append((self._epoch, frees))

    def reader_enter(self) -> int:
        """A read looked its blocks up now; returns its epoch (give it to `reader_exit`)."""
        epoch = self._epoch
        self._readers[epoch] += 1
        return epoch

    def reader_exit(self, epoch: int) -> bool:
        """A read is done; True if `reclaim` may now free something."""
        readers = self._readers
        left = readers[epoch] - 1
        if left:
            readers[epoch] = left
            return False
        del readers[epoch]
        return bool(self._limbo)

    def reclaim(self) -> list[Range]:
        """Free what no running read can use; returns the ranges to discard in the file.

        Their chunks stay taken until `discarded`.
        """
        oldest = min(self._readers) if self._readers else None
        discards = []
        limbo = self._limbo
        while limbo and (oldest is None or limbo[0][0] <= oldest):
            _, frees = limbo.popleft()
            for sector, block_size, discard in frees:
                found = self._free(sector, block_size, discard=discard)
                if found is not None:
                    discards.append(found)
        return discards

    @property
    def in_limbo(self) -> int:
        """Blocks waiting in limbo."""
        return sum(len(f) for _, f in self._limbo)

    # ------------------------------------------------------------ accounting

    def used_bytes(self) -> int:
        """Bytes of chunks in use (or in limbo)."""
        return self.used_chunks * CHUNK

    def free_backed_bytes(self) -> int:
        """Bytes of free chunks that hold file space (writable without the file growing)."""
        return len(self._backed) * CHUNK

    # ------------------------------------------------------------ rebuilding

    @classmethod
    def rebuild(
        cls, chunks: Iterable[int], sectors: Iterable[int], data_ranges: list[Range]
    ) -> SpaceMap:
        """The space map of a pool whose used chunks and small-block sectors are known.

        `data_ranges` (the file's allocated [start, end) byte ranges) tells backed chunks
        from holes.
        """
        space = cls()
        used = set(chunks)
        for sector in sectors:
            chunk = sector // SECTORS_PER_CHUNK
            space._small_used[chunk] = space._small_used.get(chunk, 0) + 1
        for chunk in space._small_used:
            base = chunk * SECTORS_PER_CHUNK
            space._small_free.update(range(base, base + SECTORS_PER_CHUNK))
        for sector in sectors:
            space._small_free.discard(sector)
        used.update(space._small_used)
        space.hwm = max(used, default=FIRST_DATA_CHUNK - 1) + 1
        space.used_chunks = len(used)
        backed = _chunks_in(data_ranges, space.hwm)
        for chunk in range(FIRST_DATA_CHUNK, space.hwm):
            if chunk not in used:
                (space._backed if chunk in backed else space._holes).append(chunk)
        heapq.heapify(space._backed)
        heapq.heapify(space._holes)
        return space


def _chunks_in(ranges: list[Range], limit: int) -> set[int]:
    """Chunks below `limit` wholly inside the ranges."""
    found: set[int] = set()
    for start, end in ranges:
        first = -(-start // CHUNK)
        last = min(end // CHUNK, limit)
        found.update(range(first, last))
    return found


assert CHUNK == SECTOR * SECTORS_PER_CHUNK  # noqa: S101 - units agree

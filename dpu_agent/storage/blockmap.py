"""Block maps: which physical place holds each block of a volume or snapshot.

A map is a dict of chunks of `CHUNK_BLOCKS` consecutive blocks; a chunk is three
flat arrays (16 bytes a block), so a map costs memory for the chunks that hold
something only, and a chunk copies with three memcpys:

    phys  int64   0 = no entry (look further: the parent snapshot, or zeros),
                  1 = ZERO (reads as zeros, hides the parent: a trim over a snapshot),
                  else the pool sector (512 bytes) where the block's bytes start
    meta  uint32  stored length | flags << 16 (see dataservices.BlockRecord)
    crc   uint32  CRC32C of the stored bytes (always taken: recovery checks it)

`freeze()` hands out a view of the map that never changes again: every chunk is
marked frozen, and the next change to a frozen chunk copies it first. The checkpoint
writer serializes such a view while writes go on.

A dict has no order to search, so the map also keeps a summary of which chunks
exist: `LEVELS` dicts, level k counting the non-empty groups of `FANOUT` keys of
level k - 1 (level 0: the chunks themselves). Kept up to date as chunks come and
go (one dict update, rarely more), it lets `next_entry` jump over empty stretches:
finding the first entry at or after a block costs a few hundred dict lookups at
most, whatever the distance, so a trim of a huge, mostly empty range costs what the
range holds, not its length. Every chunk in `chunks` is in the summary (a chunk
there that is not is what a search would skip): change `chunks` only through the
methods here.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

CHUNK_SHIFT: Final = 8
CHUNK_BLOCKS: Final = 1 << CHUNK_SHIFT
CHUNK_MASK: Final = CHUNK_BLOCKS - 1
ABSENT: Final = 0
ZERO: Final = 1
FLAGS_SHIFT: Final = 16
LENGTH_MASK: Final = (1 << FLAGS_SHIFT) - 1

FANOUT_SHIFT: Final = 6
FANOUT: Final = 1 << FANOUT_SHIFT  # keys of one level a key of the level above counts
LEVELS: Final = 4  # above the chunks: the top level's keys span 2**32 blocks

_ZEROS_Q: Final = bytes(8 * CHUNK_BLOCKS)
_ZEROS_I: Final = bytes(4 * CHUNK_BLOCKS)

Entry = tuple[int, int, int]  # (phys sector, meta, crc) of a block with data


def pack_meta(length: int, flags: int) -> int:
    """The meta word of a block stored with `length` bytes and `flags`."""
    return length | flags << FLAGS_SHIFT


class Chunk:
    """`CHUNK_BLOCKS` entries. Mutated only while not frozen."""

    __slots__ = ("crc", "data", "frozen", "meta", "phys", "used")

    def __init__(self, source: Chunk | None = None) -> None:
        if source is None:
            self.phys = array("q", _ZEROS_Q)
            self.meta = array("I", _ZEROS_I)
            self.crc = array("I", _ZEROS_I)
            self.used = 0  # entries that are not ABSENT
            self.data = 0  # entries that hold data (not ABSENT, not ZERO)
        else:
            self.phys = source.phys[:]
            self.meta = source.meta[:]
            self.crc = source.crc[:]
            self.used = source.used
            self.data = source.data
        self.frozen = False

    @classmethod
    def from_arrays(cls, phys: array[int], meta: array[int], crc: array[int]) -> Chunk:
        """A chunk over loaded arrays (a checkpoint's)."""
        chunk = cls.__new__(cls)
        chunk.phys, chunk.meta, chunk.crc = phys, meta, crc
        chunk.used = sum(1 for p in phys if p)
        chunk.data = sum(1 for p in phys if p > ZERO)
        chunk.frozen = False
        return chunk


class BlockMap:
    """Block number -> entry, for one volume or snapshot. Not thread-safe (the store locks)."""

    __slots__ = ("allocated", "chunks", "levels")

    def __init__(self) -> None:
        self.chunks: dict[int, Chunk] = {}
        self.allocated = 0  # blocks with data
        # level k: key >> FANOUT_SHIFT of level k - 1 -> how many of those keys exist
        self.levels: tuple[dict[int, int], ...] = tuple({} for _ in range(LEVELS))

    def __len__(self) -> int:
        return sum(c.used for c in self.chunks.values())

    def get(self, block: int) -> int:
        """The block's phys word: ABSENT, ZERO or a sector."""
        chunk = self.chunks.get(block >> CHUNK_SHIFT)
        return ABSENT if chunk is None else chunk.phys[block & CHUNK_MASK]

    def entry(self, block: int) -> Entry | None:
        """(phys, meta, crc) of a block with data here, else None."""
        chunk = self.chunks.get(block >> CHUNK_SHIFT)
        if chunk is None:
            return None
        i = block & CHUNK_MASK
        phys = chunk.phys[i]
        return (phys, chunk.meta[i], chunk.crc[i]) if phys > ZERO else None

    def _added(self, index: int) -> None:
        """Count a chunk just put in `chunks` in the summary."""
        for level in self.levels:
            index >>= FANOUT_SHIFT
            n = level.get(index, 0)
            level[index] = n + 1
            if n:  # the group was counted above already
                return

    def _removed(self, index: int) -> None:
        """Forget a chunk just taken out of `chunks` in the summary."""
        for level in self.levels:
            index >>= FANOUT_SHIFT
            n = level[index] - 1
            if n:
                level[index] = n
                return
            del level[index]

    def _writable(self, index: int) -> Chunk:
        chunk = self.chunks.get(index)
        if chunk is None:
            chunk = self.chunks[index] = Chunk()
            self._added(index)
        elif chunk.frozen:
            chunk = self.chunks[index] = Chunk(chunk)
        return chunk

    def put(self, block: int, phys: int, meta: int = 0, crc: int = 0) -> int:
        """Set a block's entry (data, or ZERO); return the phys word it had."""
        chunk = self._writable(block >> CHUNK_SHIFT)
        i = block & CHUNK_MASK
        old = chunk.phys[i]
        chunk.phys[i] = phys
        chunk.meta[i] = meta
        chunk.crc[i] = crc
        if old == ABSENT:
            chunk.used += 1
        if old > ZERO:
            chunk.data -= 1
            self.allocated -= 1
        if phys > ZERO:
            chunk.data += 1
            self.allocated += 1
        return old

    def clear(self, block: int) -> int:
        """Remove a block's entry; return the phys word it had."""
        index = block >> CHUNK_SHIFT
        chunk = self.chunks.get(index)
        if chunk is None:
            return ABSENT
        i = block & CHUNK_MASK
        old = chunk.phys[i]
        if old == ABSENT:
            return old
        if chunk.frozen:
            chunk = self.chunks[index] = Chunk(chunk)
        chunk.phys[i] = ABSENT
        chunk.meta[i] = 0
        chunk.crc[i] = 0
        chunk.used -= 1
        if old > ZERO:
            chunk.data -= 1
            self.allocated -= 1
        if not chunk.used:
            del self.chunks[index]
            self._removed(index)
        return old

    def present(self, first: int = 0, end: int | None = None) -> Iterator[tuple[int, int]]:
        """(block, phys word) of every entry (data or ZERO) in [first, end), in order.

        Looks only at the chunks the range covers: a short range of a large map (a trim's
        slice) costs what the range holds, not what the map holds.
        """
        chunks = self.chunks
        if end is None or (end - first) >> CHUNK_SHIFT >= len(chunks):
            indices: Iterable[int] = sorted(chunks)
        else:
            indices = range(first >> CHUNK_SHIFT, ((end - 1) >> CHUNK_SHIFT) + 1)
        for index in indices:
            chunk = chunks.get(index)
            base = index << CHUNK_SHIFT
            if chunk is None or base + CHUNK_BLOCKS <= first or (end is not None and base >= end):
                continue
            phys = chunk.phys
            for i, p in enumerate(phys):
                if p and base + i >= first and (end is None or base + i < end):
                    yield base + i, p

    def next_entry(self, first: int, end: int) -> int | None:
        """The first block in [first, end) with an entry (data or ZERO), or None.

        Costs a bounded number of lookups per chunk it passes that holds entries, not
        per block or chunk of the range (see the module doc).
        """
        index, stop = first >> CHUNK_SHIFT, ((end - 1) >> CHUNK_SHIFT) + 1
        chunks = self.chunks
        while first < end:
            found = self._first_key(0, index, stop)
            if found is None:
                return None
            base = found << CHUNK_SHIFT
            phys = chunks[found].phys
            for i in range(max(first - base, 0), min(end - base, CHUNK_BLOCKS)):
                if phys[i]:
                    return base + i
            index = found + 1
            first = index << CHUNK_SHIFT
        return None

    def _first_key(self, depth: int, lo: int, hi: int) -> int | None:
        """The smallest key in [lo, hi) of summary level `depth` (0: the chunks), or None."""
        keys: dict[int, int] | dict[int, Chunk] = self.levels[depth - 1] if depth else self.chunks
        if depth == LEVELS:  # the top: look at its few keys, or at the range if shorter
            if hi - lo <= len(keys):
                return next((k for k in range(lo, hi) if k in keys), None)
            return min((k for k in keys if lo <= k < hi), default=None)
        while lo < hi:
            # a group counted above holds a key; one the range covers only in part may
            # hold none in it (at most the two at its ends): then on to the next group
            group = self._first_key(depth + 1, lo >> FANOUT_SHIFT, ((hi - 1) >> FANOUT_SHIFT) + 1)
            if group is None:
                return None
            start = max(lo, group << FANOUT_SHIFT)
            lo = min(hi, (group + 1) << FANOUT_SHIFT)
            for key in range(start, lo):
                if key in keys:
                    return key
        return None

    def has_data_from(self, first: int) -> bool:
        """True if some block >= `first` has data."""
        return any(p > ZERO for _, p in self.present(first))

    def has_entries_in(self, first: int, end: int) -> bool:
        """True if some block in [first, end) has an entry (data or ZERO)."""
        return next(self.present(first, end), None) is not None

    def freeze(self) -> dict[int, Chunk]:
        """A view of the map as it is now, which later changes do not touch."""
        for chunk in self.chunks.values():
            chunk.frozen = True
        return dict(self.chunks)

    def adopt(self, index: int, chunk: Chunk) -> None:
        """Take a whole chunk from another map (which forgets it)."""
        chunk.frozen = True  # it may be in a checkpoint's view: copy before changing it
        self.load(index, chunk)

    def load(self, index: int, chunk: Chunk) -> None:
        """Put a whole chunk at `index` (loaded from a checkpoint, or adopted)."""
        old = self.chunks.get(index)
        if old is not None:
            self.allocated -= old.data
        else:
            self._added(index)
        self.chunks[index] = chunk
        self.allocated += chunk.data

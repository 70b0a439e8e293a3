"""The metadata log: records appended in memory, made durable in groups (group commit).

Every change to the store's metadata is a record (layout.RECORDS). `append` adds one
to the pending log blocks, under the engine's lock, right after the change is applied
in memory. `wait(seq)` returns once record `seq` is durable: the first caller that
finds no commit running becomes the leader, takes every pending block, writes them
into their reserved places in the pool and syncs the pool once, without the lock;
callers that arrive meanwhile wait for that commit and then, if their record was
not in it, one of them leads the next, which takes everything that gathered in the
meantime. So N concurrent FUA writes or flushes cost about two syncs, not N, and a
writer that does not ask for durability never waits for a sync.

The data a record points to is written (to the page cache) before the record is
appended, and the leader syncs the pool after writing the log blocks: one fdatasync
makes both durable together. Commits run one after another, and every log block
starts with a BATCH record naming the first block of its commit, so recovery knows
which blocks were synced together. After a crash the last commit's log blocks may
have reached the disk without the data they point to; recovery checks each block's
CRC32C and ends that commit's replay at the first write whose data does not match
(nothing from there on was acknowledged durable: the sync never returned).

The log is a chain of 4 KiB pool chunks: each block names the chunk where the next
one will go, reserved before the block is written. Log chunks are taken from a
reserve of chunks that already hold file space, filled up by `reserve()` before a
change is applied (the only place that may fail for lack of space), so a commit
never needs space the disk does not have. Blocks a checkpoint covers go back to
the reserve or to the pool.

A background thread commits what writers leave pending (every `COMMIT_INTERVAL_S`,
or sooner when `COMMIT_BLOCKS` blocks gathered) and writes checkpoints: when the log
since the last checkpoint exceeds the larger of `checkpoint_log_bytes` and the last
checkpoint's size, the leader captures the state as of its batch (cheap: block maps
are frozen, not copied) and the thread writes it after the batch is durable.

A failed log write or sync leaves the store failed: the change is in memory but
may not be on disk, so every later change or wait raises Unavailable until the
agent restarts and recovers from what is durable (as a file system remounts
read-only after a journal error).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import threading
from typing import TYPE_CHECKING, Final, Generic, Protocol, TypeVar

from dpu_agent.errors import FailedPrecondition, ResourceExhausted, Unavailable
from dpu_agent.storage.layout import (
    CHUNK,
    RECORD_ROOM,
    SECTOR,
    SECTORS_PER_CHUNK,
    WRITE,
    LogPosition,
    batch_record,
    pack_log_block,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from dpu_agent.storage.media import StoreFile
    from dpu_agent.storage.space import Range, SpaceMap
    from dpu_agent.storage.state import Free

log = logging.getLogger(__name__)

COMMIT_INTERVAL_S: Final = 1.0  # pending records older than this are committed by the thread
COMMIT_BLOCKS: Final = 64  # pending log blocks that wake the thread at once
EMERGENCY_CHUNKS: Final = 4  # reserve only changes that free space may use
RESERVE_MAX: Final = 256  # log chunks kept in reserve beyond what is promised
DEFAULT_CHECKPOINT_LOG_BYTES: Final = 1 << 20
# Chunks the log gives file space to when it finds no free chunk with file space: holes
# if there are (else as many chunks past the end of the pool), written with zeros, so
# the file's blocks are allocated (and fdatasync journals them) once per GROW_CHUNKS,
# not at every commit.
GROW_CHUNKS: Final = 64


class Image(Protocol):
    """A checkpoint to be written: the state as of `position` in the log."""

    @property
    def position(self) -> LogPosition:
        """Where the log goes on after the checkpoint."""


ImageT = TypeVar("ImageT", bound=Image)
T = TypeVar("T")


@dataclasses.dataclass
class _Batch:
    blocks: list[tuple[int, bytes, int]]  # (sector, block, seq)
    frees: list[Free]
    written: list[Sequence[int]]  # the data sectors its WRITE records name
    last: int  # the last record in it


def blocks_for(nbytes: int) -> int:
    """Log blocks to reserve for records of `nbytes` in total (records never span blocks)."""
    return 1 + nbytes // (RECORD_ROOM // 2)


class Journal(Generic[ImageT]):
    """Group commit of metadata records into a chain of log blocks in the pool."""

    def __init__(  # noqa: PLR0913 - the pieces it ties together
        self,
        pool: StoreFile,
        lock: threading.Lock,
        space: SpaceMap,
        position: LogPosition,
        *,
        capture: Callable[[LogPosition], ImageT],
        persist: Callable[[ImageT], int],
        checkpoint_log_bytes: int = DEFAULT_CHECKPOINT_LOG_BYTES,
        live_blocks: list[tuple[int, int]] | None = None,
    ) -> None:
        self._pool = pool
        self._lock = lock
        self._cond = threading.Condition(lock)
        self._space = space
        self._pos = position
        self._capture = capture
        self._persist = persist
        self._checkpoint_min = checkpoint_log_bytes
        self._blocks: list[list[bytes]] = []  # pending log blocks, as lists of records
        self._fill = 0  # payload bytes in the last pending block
        self._frees: list[Free] = []
        self._written: list[Sequence[int]] = []  # data sectors of the pending WRITE records
        # What the last commit freed of the data its own WRITE records point to: reused
        # only once a later commit is durable, so that recovery may read a write in the
        # last commit on disk whose data does not match as lost (that sync never
        # returned), never as space reused after it returned. Space written by earlier
        # commits is not judged by recovery again (a previous run's last commit is
        # pinned at open instead), so it is reusable as soon as its commit is durable.
        self._held: list[Free] = []
        self._held_last = 0  # the last record of that commit
        self.appended = 0  # records appended so far
        self.durable = 0  # records durable so far
        self._committing = False
        self._failed: str | None = None
        self._reserve: list[int] = []  # log chunks with file space, for next pointers
        self._promised = 0  # blocks promised to changes not yet appended
        # log blocks since the last checkpoint (seq, sector): freed by the next checkpoint
        self._live: list[tuple[int, int]] = list(live_blocks or [])
        self._since_checkpoint = len(self._live) * CHUNK
        self._last_checkpoint_bytes = 0
        self._checkpointing = False
        self._images: list[ImageT] = []
        self.checkpoints = 0  # written since open
        self.commits = 0  # log syncs since open
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the background committer (after recovery)."""
        self._thread = threading.Thread(target=self._loop, name="volume-store-journal", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Commit what is pending, write a last checkpoint, stop the thread."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._failed is None:
            images, image = self._when_settled(self._last_images)
            try:  # a last checkpoint only spares the next open some replay
                for queued in [*images, *([image] if image is not None else [])]:
                    self._write_checkpoint(queued)
            except OSError as exc:
                log.warning(
                    "could not write a checkpoint at close; the log will be replayed at open",
                    extra={"error": exc.strerror},
                )

    @property
    def failed(self) -> bool:
        """True once a commit failed (see the module doc)."""
        return self._failed is not None

    def check(self) -> None:
        """Unavailable if the store failed. Call under the lock."""
        if self._failed is not None:
            raise Unavailable(
                f"the volume store could not write its metadata log ({self._failed}); "
                "restart the agent to recover"
            )

    # ------------------------------------------------------------ appending (under the lock)

    def reserve(self, nbytes: int, *, emergency: bool = False) -> int:
        """Promise log room for records of `nbytes`; returns the promise for `append`.

        ResourceExhausted if the file system has no room for the log blocks. A change
        that frees space (`emergency`) may use the last few chunks of the reserve.
        """
        self.check()
        promise = blocks_for(nbytes)
        need = len(self._blocks) + self._promised + promise
        if not emergency:
            need += EMERGENCY_CHUNKS
        while len(self._reserve) < need:
            self._reserve.append(self._new_log_chunk())
        self._promised += promise
        return promise

    def unreserve(self, promise: int) -> None:
        """Take back a promise that will not be used."""
        self._promised -= promise

    def _new_log_chunk(self) -> int:
        sector = self._space.take_backed()
        if sector is not None:
            return sector
        # Holes first (chunks a trim or a delete gave back): else data, which takes
        # chunks with file space first, would keep using up what each growth adds while
        # the holes stay unused, and the file would grow for ever under writes and trims.
        run = self._space.take_holes(GROW_CHUNKS) or self._space.take_fresh_run(GROW_CHUNKS)
        try:
            self._zero(run)
        except OSError:  # too little room for a run: one chunk may still fit
            self._space.release(run, CHUNK, backed=False)
        else:
            self._space.release(run[1:], CHUNK, backed=True)
            return run[0]
        sector = self._space.take_fresh()
        try:
            self._pool.pwrite(bytes(CHUNK), sector * SECTOR)
        except OSError as exc:
            self._space.release([sector], CHUNK, backed=False)
            if exc.errno in {errno.ENOSPC, errno.EDQUOT}:
                raise ResourceExhausted(
                    f"no space left for the volume store's metadata log: {exc.strerror}"
                ) from exc
            raise
        return sector

    def _zero(self, sectors: list[int]) -> None:
        """Write zeros over these chunks, one call per run of adjacent ones."""
        start = 0
        for i in range(1, len(sectors) + 1):
            if i == len(sectors) or sectors[i] != sectors[i - 1] + SECTORS_PER_CHUNK:
                self._pool.pwrite(bytes((i - start) * CHUNK), sectors[start] * SECTOR)
                start = i

    def append(
        self, record: bytes, frees: list[Free], promise: int = 0, written: Sequence[int] = ()
    ) -> int:
        """Add a record (changes already applied); returns its number for `wait`.

        A WRITE record comes with `written`, the pool sectors its entries point to.
        """
        if written:
            self._written.append(written)
        elif record[0] == WRITE:
            raise ValueError("a WRITE record is appended with the sectors it points to")
        if not self._blocks or self._fill + len(record) > RECORD_ROOM:
            self._blocks.append([])
            self._fill = 0
        self._blocks[-1].append(record)
        self._fill += len(record)
        self._frees.extend(frees)
        self._promised -= promise
        self.appended += 1
        if len(self._blocks) >= COMMIT_BLOCKS:
            self._wake.set()
        return self.appended

    # ------------------------------------------------------------ committing

    def wait(self, seq: int) -> None:
        """Return once record `seq` (and every one before it) is durable."""
        while True:
            with self._cond:
                while self._committing and self.durable < seq:
                    self._cond.wait()
                if self.durable >= seq:
                    return
                self.check()
                if not self._blocks:  # nothing pending: every record is durable
                    return
                batch = self._take_batch()
                image: ImageT | None = None
                if not self._checkpointing and self._since_checkpoint + len(
                    batch.blocks
                ) * CHUNK >= max(self._checkpoint_min, self._last_checkpoint_bytes):
                    self._checkpointing = True
                    image = self._capture(self._pos)
                self._committing = True
            self._run(batch)
            if image is not None:
                with self._lock:
                    self._images.append(image)
                self._wake.set()

    def _take_batch(self) -> _Batch:
        pos = self._pos
        mark = batch_record(pos.seq)  # each block names the commit it is written in
        blocks = []
        for records in self._blocks:
            if self._reserve:
                nxt = self._reserve.pop()
            else:  # a promise was broken; the write may need space (and fail)
                log.warning("the metadata log ran out of reserved chunks")
                nxt = self._space.take_fresh()
            blocks.append(
                (
                    pos.head,
                    pack_log_block(pos.salt, pos.prev_salt, pos.seq, nxt, mark + b"".join(records)),
                    pos.seq,
                )
            )
            pos = LogPosition(nxt, pos.seq + 1, pos.salt, pos.salt)
        self._pos = pos
        batch = _Batch(blocks, self._frees, self._written, self.appended)
        self._blocks, self._fill, self._frees, self._written = [], 0, [], []
        return batch

    def _run(self, batch: _Batch) -> None:
        """Write and sync a batch (without the lock), then publish it."""
        try:
            for sector, block, _ in batch.blocks:
                self._pool.pwrite(block, sector * SECTOR)
            self._pool.sync()
        except BaseException as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else repr(exc)
            log.exception("the volume store's metadata log failed")
            with self._cond:
                self._failed = reason
                self._committing = False
                self._cond.notify_all()
                try:
                    self.check()
                except Unavailable as failed:
                    raise failed from exc
            raise
        with self._cond:
            self.durable = batch.last
            self._committing = False
            self.commits += 1
            self._live.extend((seq, sector) for sector, _, seq in batch.blocks)
            self._since_checkpoint += len(batch.blocks) * CHUNK
            self._space.retire(self._held)  # a later commit (this one) is durable now
            held, free_now = _split_frees(batch.frees, batch.written)
            self._space.retire(free_now)
            self._held, self._held_last = held, batch.last
            discards = self._space.reclaim()
            self._cond.notify_all()
        self.discard(discards)

    def discard(self, ranges: list[Range]) -> None:
        """Give freed ranges back to the file system, then to the space map for reuse.

        `ranges` come from `SpaceMap.reclaim`. Call without the lock; failures are only
        logged (the chunks are reused all the same).
        """
        if not ranges:
            return
        done, failed = [], []
        for offset, length in _merged(ranges):
            try:
                self._pool.discard(offset, length)
            except OSError as exc:
                log.warning("could not discard freed pool space", extra={"error": exc.strerror})
                failed.append((offset, length))
            else:
                done.append((offset, length))
        with self._lock:
            self._space.discarded(done)
            self._space.discarded(failed, backed=True)

    # ------------------------------------------------------------ the thread

    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(COMMIT_INTERVAL_S)
            self._wake.clear()
            if self._stopping.is_set():
                break
            try:
                with self._lock:
                    pending = self.appended if self.appended > self.durable else 0
                    images, self._images = self._images, []
                if pending:
                    self.wait(pending)
                else:  # idle: what the last commit freed becomes reusable
                    self.release_frees(self._held_last)
                for image in images:
                    self._write_checkpoint(image)
            except Exception:
                log.exception("the volume store's background commit failed")

    def release_frees(self, seq: int) -> None:
        """Return once the space the commit of record `seq` freed is reusable.

        Call after `wait(seq)`. Space that commit's own WRITE records pointed to needs a
        later durable commit (see `_held`); with nothing else to commit, that is an empty
        log block. Without such space, this returns at once.
        """
        while True:
            with self._cond:
                if not self._held or self._held_last < seq:
                    return
                self.check()
                if self._committing:
                    self._cond.wait()
                    continue
                if not self._blocks:
                    try:
                        promise = self.reserve(0, emergency=True)
                    except ResourceExhausted:  # no room for a log block: the next commit
                        return  # frees the space (the change itself is durable already)
                    self._blocks.append([])  # a block with only its BATCH record
                    self._fill = 0
                    self._promised -= promise
                batch = self._take_batch()
                self._committing = True
            self._run(batch)

    def _write_checkpoint(self, image: ImageT) -> None:
        try:
            size = self._persist(image)
        except BaseException:
            with self._cond:
                self._checkpointing = False
                self._cond.notify_all()
            raise
        position = image.position
        with self._cond:
            self._checkpointing = False
            self._cond.notify_all()
            self.checkpoints += 1
            self._last_checkpoint_bytes = size
            covered = [sector for seq, sector in self._live if seq < position.seq]
            self._live = [(seq, sector) for seq, sector in self._live if seq >= position.seq]
            self._since_checkpoint = len(self._live) * CHUNK
            keep = max(0, RESERVE_MAX + self._promised + len(self._blocks) - len(self._reserve))
            self._reserve.extend(covered[:keep])
            self._space.release(covered[keep:], CHUNK, backed=True)

    def checkpoint_now(self) -> None:
        """Commit everything and write a checkpoint now (after any being written)."""
        while (image := self._when_settled(self._take_image)) is None:
            with self._cond:
                if self._thread is None:  # before start() (an upgrade's import): one a
                    queued, self._images = self._images, []  # commit captured is ours
                else:
                    queued = []
                    self._cond.wait(0.1)  # the thread is writing one: it notifies when done
            for earlier in queued:
                self._write_checkpoint(earlier)
        self._write_checkpoint(image)

    def _when_settled(self, fn: Callable[[], T]) -> T:
        """`fn()` under the lock, once every record appended is durable and no commit runs.

        A checkpoint is the state as of the end of the log: captured while a record is
        pending or a batch is being synced, it would hold changes whose data may not be
        durable when the checkpoint is, and the log after it would repeat them.
        """
        while True:
            self.wait(self.appended)
            with self._cond:
                if not self._blocks and not self._committing:
                    return fn()

    def _take_image(self) -> ImageT | None:
        """The state now, to be written as a checkpoint; None while one is being written."""
        if self._checkpointing:
            self.check()
            if self._thread is None and not self._images:
                raise FailedPrecondition("a checkpoint is pending and nothing writes it")
            return None
        self._checkpointing = True
        return self._capture(self._pos)

    def _last_images(self) -> tuple[list[ImageT], ImageT | None]:
        """At close: the checkpoints captured and not written, or else one of the state now."""
        images, self._images = self._images, []
        image: ImageT | None = None
        if not images and self._since_checkpoint and not self._checkpointing:
            self._checkpointing = True
            image = self._capture(self._pos)
        return images, image


def _merged(ranges: list[Range]) -> list[Range]:
    out: list[Range] = []
    for offset, length in sorted(ranges):
        if out and out[-1][0] + out[-1][1] == offset:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((offset, length))
    return out


def _split_frees(frees: list[Free], written: list[Sequence[int]]) -> tuple[list[Free], list[Free]]:
    """(what to hold: frees of sectors the same commit's WRITE records name, the rest)."""
    if not frees or not written:
        return [], frees
    mine = {sector for sectors in written for sector in sectors}
    held = [free for free in frees if free[0] in mine]
    if not held:
        return [], frees
    return held, [free for free in frees if free[0] not in mine]

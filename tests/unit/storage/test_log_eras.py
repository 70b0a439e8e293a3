"""Recovery follows the log across eras, whenever the checkpoint was taken.

Each open of a store starts a new era of the metadata log: a new salt, and a first
block that names the salt of the era before it. A checkpoint records where the log
goes on after it. One taken at the very start of an era, before that era's first
block, must still lead recovery to that block: before 2026-11-27 it recorded the new
era's salt, recovery found the first block naming the old one, stopped there, and
every change logged after the checkpoint was lost, acknowledged FUA writes included.
And a checkpoint is the state as of the end of the durable log, never more.
"""

from __future__ import annotations

import contextlib
import logging

import pytest

from dpu_agent.errors import AgentError, ResourceExhausted
from dpu_agent.storage import DataServices
from dpu_agent.storage import journal as journal_module
from dpu_agent.storage.engine import CowVolumeStore
from dpu_agent.storage.keys import KeySealer
from dpu_agent.storage.layout import write_record
from tests.torture.faulty_media import FaultyMedia, _put

SEALER = KeySealer(bytes(32))
BS = 4096


def _cut(media: FaultyMedia, store: CowVolumeStore) -> FaultyMedia:
    """The media after a power cut that loses everything not synced (`store` stops)."""
    image = media.image()
    with contextlib.suppress(AgentError, OSError):  # no power: closing cannot write
        store.close()
    return FaultyMedia(image, keep=0.0, tear=0.0)


def _open(media: FaultyMedia) -> CowVolumeStore:
    return CowVolumeStore(media, SEALER)


@pytest.fixture(autouse=True)
def _quiet() -> None:
    logging.getLogger("dpu_agent.storage").setLevel(logging.CRITICAL)  # the cuts' noise


def _crashed_store_with_a_log() -> FaultyMedia:
    """A store whose last run logged a volume and a FUA write, then lost power."""
    media = FaultyMedia(keep=0.0, tear=0.0)
    store = _open(media)
    store.create("v", 16 * BS, BS, DataServices(crc32c=True))
    store.write("v", 0, b"a" * BS, fua=True)
    return _cut(media, store)


def test_a_checkpoint_before_an_eras_first_block_keeps_what_follows():
    media = _crashed_store_with_a_log()
    store = _open(media)  # replays the log: a new era starts
    store.checkpoint()  # before the era wrote anything
    store.write("v", BS, b"b" * BS, fua=True)
    store.create("w", 16 * BS, BS, DataServices())
    after = _open(_cut(media, store))
    try:
        assert after.read("v", 0, BS) == b"a" * BS
        assert after.read("v", BS, BS) == b"b" * BS, "an acknowledged FUA write was lost"
        assert [v.volume_id for v in after.list()] == ["v", "w"]
    finally:
        after.close()


def test_eras_that_write_nothing_keep_the_chain():
    """Open and close (a checkpoint at the era's start, nothing logged), twice; then
    write in a third run and cut: the write is there."""
    media = _crashed_store_with_a_log()
    for _ in range(2):
        store = _open(media)
        store.close()
    store = _open(media)
    store.write("v", 2 * BS, b"c" * BS, fua=True)
    after = _open(_cut(media, store))
    try:
        assert after.read("v", 0, BS) == b"a" * BS
        assert after.read("v", 2 * BS, BS) == b"c" * BS
    finally:
        after.close()


def test_a_checkpoint_never_holds_a_change_whose_data_is_not_durable():
    """A write appended while `checkpoint()` runs (after it committed, before it captured
    the state) is committed before the capture: the checkpoint, durable at once, must not
    point at data that a power cut may still lose."""
    media = FaultyMedia(keep=0.0, tear=0.0)
    store = _open(media)
    store.create("v", 16 * BS, BS, DataServices(crc32c=True))
    store.write("v", BS, b"o" * BS, fua=True)
    journal = store._journal
    wait = journal.wait
    armed = [True]

    def wait_then_a_write_arrives(seq: int) -> None:
        wait(seq)
        if armed[0]:
            armed[0] = False
            store.write("v", BS, b"n" * BS)  # not durable: its data is in the cache only

    journal.wait = wait_then_a_write_arrives  # type: ignore[method-assign]
    store.checkpoint()
    after = _open(_cut(media, store))
    try:
        assert after.read("v", BS, BS) in {b"o" * BS, b"n" * BS}
    finally:
        after.close()


class _KeepTheLastWrite(FaultyMedia):
    """At the cut, only the pool's last queued write survives: the commit's log block
    reaches the disk, the data written before it does not (as a disk's cache may do)."""

    def _cut(self) -> None:
        image = {name: bytearray(f.stable) for name, f in self.files.items()}
        pool = self.files.get("pool")
        if pool is not None and pool.queued:
            offset, raw = pool.queued[-1]
            _put(image["pool"], offset, raw)
        self._image = image
        self.dead = True


def test_a_change_logged_after_a_write_whose_data_was_lost_is_dropped_with_it():
    """A snapshot requested after a write was acknowledged holds that write, or does not
    exist: the cut keeps the snapshot's log block and loses the write's data."""
    media = _KeepTheLastWrite()
    store = _open(media)
    store.create("v", 16 * BS, BS, DataServices(crc32c=True))
    store.write("v", 0, b"o" * BS, fua=True)
    store.write("v", 0, b"n" * BS)  # acknowledged, not durable
    media.cut_at_sync = media.syncs + 1  # the power goes as the snapshot's commit syncs
    with pytest.raises(AgentError):
        store.create_snapshot("v", "s")
    after = _open(_cut(media, store))
    try:
        assert after.read("v", 0, BS) in {b"o" * BS, b"n" * BS}
        snapshots = [s.snapshot_id for s in after.list_snapshots()]
        if snapshots:
            after.clone("s", "c")
            assert after.read("c", 0, BS) == b"n" * BS, "the snapshot lost an acknowledged write"
        assert snapshots == [], "the snapshot's record came after the write that was lost"
    finally:
        after.close()


def test_a_log_written_before_batch_records_replays(monkeypatch):
    """Log blocks from before BATCH records (each then counts as a commit of its own)."""
    monkeypatch.setattr(journal_module, "batch_record", lambda _first: b"")
    media = FaultyMedia(keep=0.0, tear=0.0)
    store = _open(media)
    store.create("v", 16 * BS, BS, DataServices(crc32c=True))
    for block in range(8):
        store.write("v", block * BS, bytes([block + 1]) * BS, fua=block % 2 == 0)
    store.create_snapshot("v", "s")
    monkeypatch.undo()
    after = _open(_cut(media, store))
    try:
        assert after.read("v", 0, 8 * BS) == b"".join(bytes([b + 1]) * BS for b in range(8))
        assert [s.snapshot_id for s in after.list_snapshots()] == ["s"]
    finally:
        after.close()


def test_recovery_judges_a_runs_last_commit_the_same_way_every_time():
    """Until a checkpoint covers it, every recovery judges the last commit before a crash
    again; the space its writes name is pinned (not reused) until the store reopens. Had
    a write's space been freed and reused, a later recovery would end that commit's
    replay there and lose what the store since built on (here, a volume's creation).
    """
    media = FaultyMedia(keep=1.0, tear=0.0)  # the cut keeps every write it finds queued
    store = _open(media)
    store.create("v", 16 * BS, BS, DataServices(crc32c=True))
    store.write("v", 0, b"a" * BS, fua=True)
    store.write("v", BS, b"b" * BS)
    media.cut_at_sync = media.syncs + 1  # the power goes as the next commit syncs
    with pytest.raises(AgentError):
        store.create("w", 16 * BS, BS, DataServices(crc32c=True))
    media = _cut(media, store)  # that commit is on disk whole, its sync never returned
    store = _open(media)
    assert [v.volume_id for v in store.list()] == ["v", "w"]
    store.write("v", BS, b"B" * BS, fua=True)  # frees the space "b" was in: reused below
    for block in range(16):
        store.write("w", block * BS, bytes([block]) * BS, fua=True)
    after = _open(_cut(media, store))
    try:
        assert after.read("v", 0, 2 * BS) == b"a" * BS + b"B" * BS
        assert after.read("w", 0, 16 * BS) == b"".join(bytes([b]) * BS for b in range(16))
    finally:
        after.close()


def test_space_a_commit_frees_waits_for_a_later_commit():
    """A block written and overwritten within one commit: the first write's space is not
    reused until a later commit is durable. Reused at once, a power cut after its new
    data landed (and before any later commit) would leave recovery a last commit whose
    first write does not match its data, read as a commit that never synced: the FUA
    write acknowledged in it would be dropped."""
    media = FaultyMedia(keep=1.0, tear=0.0)
    store = _open(media)
    store.create("v", 16 * BS, BS, DataServices(crc32c=True))
    store.write("v", 0, b"1" * BS)
    store.write("v", 0, b"2" * BS, fua=True)  # one commit with both; frees the first's space
    for block in range(1, 4):
        store.write("v", block * BS, b"x" * BS)  # not committed; their data reaches the disk
    after = _open(_cut(media, store))
    try:
        assert after.read("v", 0, BS) == b"2" * BS, "an acknowledged FUA write was lost"
    finally:
        after.close()


def test_a_log_from_before_batch_records_is_replayed_entry_by_entry(monkeypatch):
    """The code before BATCH records reused freed space at once: in its log a last
    commit's write that does not match its data may have lost it to reuse after a sync
    that returned, so it is skipped alone (the FUA write after it stays)."""
    run = journal_module.Journal._run

    def run_and_reuse_at_once(self, batch):
        run(self, batch)
        with self._cond:
            self._space.retire(self._held)
            self._held = []
            discards = self._space.reclaim()
        self.discard(discards)

    monkeypatch.setattr(journal_module, "batch_record", lambda _first: b"")
    monkeypatch.setattr(journal_module.Journal, "_run", run_and_reuse_at_once)
    media = FaultyMedia(keep=1.0, tear=0.0)
    store = _open(media)
    store.create("v", 16 * BS, BS, DataServices(crc32c=True))
    store.write("v", 0, b"1" * BS)
    store.write("v", 0, b"2" * BS, fua=True)
    for block in range(1, 4):
        store.write("v", block * BS, b"x" * BS)
    image = _cut(media, store)
    monkeypatch.undo()
    after = _open(image)
    try:
        assert after.read("v", 0, BS) == b"2" * BS, "an acknowledged FUA write was lost"
    finally:
        after.close()


def test_a_trim_returns_though_no_log_block_is_left_to_free_its_space_at_once():
    """A trim that frees space written in its own commit commits once more, so that the
    space is free when it returns; with no room for that empty log block it returns all
    the same (the trim is durable), and the space is freed by the next commit."""
    media = FaultyMedia(keep=0.0, tear=0.0)
    store = _open(media)
    store.create("v", 16 * BS, BS, DataServices(crc32c=True))
    store.write("v", 0, b"a" * 2 * BS, fua=True)
    store.write("v", 0, b"c" * BS)  # pending: committed with the trim, which frees it
    journal = store._journal
    reserve = journal.reserve

    def no_room_for_an_empty_block(nbytes: int, *, emergency: bool = False) -> int:
        if nbytes == 0:
            raise ResourceExhausted("no space left for the volume store's metadata log")
        return reserve(nbytes, emergency=emergency)

    journal.reserve = no_room_for_an_empty_block  # type: ignore[method-assign]
    store.trim("v", 0, BS)
    trimmed = list(journal._held)
    assert trimmed, "the trim's space waits for the next commit"
    store.write("v", BS, b"b" * BS, fua=True)
    assert not set(trimmed) & set(journal._held), "the next commit freed the trim's space"
    after = _open(_cut(media, store))
    try:
        assert after.read("v", 0, 2 * BS) == bytes(BS) + b"b" * BS
    finally:
        after.close()


def test_a_trim_of_older_data_frees_it_without_another_commit():
    """Space written by an earlier commit is not judged again by recovery, so a trim of
    it needs no second commit: its space is reusable once the trim is durable."""
    media = FaultyMedia(keep=1.0, tear=0.0)
    store = _open(media)
    store.create("v", 16 * BS, BS, DataServices(crc32c=True))
    store.write("v", 0, b"a" * 2 * BS, fua=True)
    journal = store._journal
    commits = journal.commits
    store.trim("v", 0, BS)
    assert journal.commits == commits + 1, "the trim committed more than once"
    assert not journal._held
    store.write("v", 2 * BS, b"b" * BS, fua=True)  # may reuse the trimmed space
    after = _open(_cut(media, store))
    try:
        assert after.read("v", 0, 3 * BS) == bytes(BS) + b"a" * BS + b"b" * BS
    finally:
        after.close()


def test_a_write_record_without_its_sectors_is_refused():
    """The hold above depends on knowing what each WRITE record points to."""
    media = FaultyMedia(keep=1.0, tear=0.0)
    store = _open(media)
    try:
        with pytest.raises(ValueError, match="sectors"):
            store._journal.append(write_record(1, 0, [(64, 0, 0)]), [])
    finally:
        store.close()

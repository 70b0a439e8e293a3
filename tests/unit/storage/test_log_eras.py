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

from dpu_agent.errors import AgentError
from dpu_agent.storage import DataServices
from dpu_agent.storage.engine import CowVolumeStore
from dpu_agent.storage.keys import KeySealer
from tests.torture.faulty_media import FaultyMedia

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

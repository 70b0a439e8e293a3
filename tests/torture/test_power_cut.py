"""Power cuts under the store at random instants, every data service, all kinds of change.

See workload.py for what runs and model.py for what is checked. The last tests break
the engine's ordering on purpose (in the test, by swapping a piece of it) and show
that the same checker then finds the damage: it is not passing for lack of teeth.
"""

from __future__ import annotations

import re
import time

import pytest

from dpu_agent.storage import journal as journal_module
from dpu_agent.storage.engine import CowVolumeStore
from dpu_agent.storage.layout import SECTOR
from tests.torture import workload

CUTS = 320
# What a broken ordering breaks: data (a block that reads wrong), or an acknowledged
# creation, deletion or resize undone (recovery ends the last commit's replay at its first
# write whose data is not on disk, and drops what that commit logged after it).
ANY_ACKED_CHANGE = "reads|gone|is back|blocks, not"
BROKEN_CUTS = 600  # at most: each stops at the first violation found


def test_every_block_reads_old_or_new_after_hundreds_of_power_cuts():
    stats = workload.run(CUTS)
    print(f"\n{stats.line()}")  # noqa: T201 - the numbers the report quotes
    assert stats.cycles == CUTS
    assert stats.acked_writes > 10 * CUTS, "too little was written to mean anything"
    assert stats.durable_writes > 0
    assert stats.snapshots_checked > CUTS // 4
    assert stats.violations == [], "\n".join(stats.violations[:40])


# ---------------------------------------------------------------- broken on purpose


def _acknowledge_before_sync(self, batch):
    """Journal._run, mis-ordered: publish the batch as durable, then write and sync it."""
    with self._cond:
        self.durable = batch.last
        self._committing = False
        self._live.extend((seq, sector) for sector, _, seq in batch.blocks)
        self._space.retire(batch.frees)
        discards = self._space.reclaim()
        self._cond.notify_all()
    self.discard(discards)
    time.sleep(0.002)  # the disk is slow: the waiters run before the sync, as they would
    try:
        for sector, block, _ in batch.blocks:
            self._pool.pwrite(block, sector * SECTOR)
        self._pool.sync()
    except OSError:
        with self._cond:
            self._failed = "power"


def _reuse_at_once(self, record, frees, promise=0, written=()):
    """Journal.append, mis-ordered: the blocks a change frees are reusable at once, before
    the change is durable (the old data may be overwritten while it is still the
    durable version)."""
    for sector, block_size, _ in frees:
        self._space.release([sector], block_size, backed=True)
    return _append(self, record, [], promise, written)


_append = journal_module.Journal.append


def _trust_every_record(_self, _node, _block, _entry):
    """CowVolumeStore._verify, removed: replay applies records whose data never landed."""
    return True


@pytest.mark.parametrize(
    ("target", "name", "broken", "symptom"),
    [
        (journal_module.Journal, "_run", _acknowledge_before_sync, ANY_ACKED_CHANGE),
        (journal_module.Journal, "append", _reuse_at_once, ANY_ACKED_CHANGE),
        (CowVolumeStore, "_verify", _trust_every_record, "reads"),
    ],
    ids=["ack-before-sync", "reuse-before-durable", "no-crc-check-on-replay"],
)
def test_the_checker_catches_broken_ordering(monkeypatch, target, name, broken, symptom):
    monkeypatch.setattr(target, name, broken)
    stats = workload.run(BROKEN_CUTS, until_violation=True)
    print(f"\nbroken {name}: {stats.line()}")  # noqa: T201
    for line in stats.violations[:6]:
        print(f"  {line}")  # noqa: T201
    assert len(stats.violations) > 1, f"the checker missed a broken ordering in {stats.cycles} cuts"
    assert any(re.search(symptom, v) for v in stats.violations[1:])

"""The measurements behind the block store's design (docs/architecture.md, "The block store").

Not part of `make bench` (no headline figures): run `python -m bench.storage_design`
on the file system the store will use. It prints, for 4 KiB random writes:

1. durable QD1 write, at the syscall level, as each candidate design would issue it:
   - in place (engine v1): pwrite the block, fdatasync, then commit its record in
     SQLite (WAL, synchronous=FULL): two syncs in a row;
   - copy-on-write (engine v2): pwrite the block to a free place and its log block,
     one fdatasync;
   - data journal: append block + record to a journal, one fdatasync; the block is
     written again in place later (its cost shows in write amplification);
   - the floor: pwrite + fdatasync.
2. metadata commit cost: SQLite (WAL, FULL) per transaction of 1 and of 32 block
   records, against our log (pack a log block, pwrite, fdatasync);
3. bytes written per 4 KiB block written, per design (write amplification), with a
   group of 1 and of 32 writes per commit.
"""

from __future__ import annotations

import os
import random
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

from bench import common
from dpu_agent.storage.layout import pack_log_block, write_record

BLOCK = 4096
FILE = 64 << 20
OPS = 600
ROUNDS = 3


def _file(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    chunk = os.urandom(1 << 20)
    for at in range(0, FILE, len(chunk)):
        os.pwrite(fd, chunk, at)
    os.fsync(fd)
    return fd


def _sqlite(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute(
        "CREATE TABLE IF NOT EXISTS blocks (volume_id TEXT, block INTEGER, length INTEGER,"
        " flags INTEGER, crc INTEGER, PRIMARY KEY (volume_id, block)) WITHOUT ROWID"
    )
    return db


def _commit_rows(db: sqlite3.Connection, rng: random.Random, rows: int) -> None:
    db.execute("BEGIN IMMEDIATE")
    db.executemany(
        "INSERT OR REPLACE INTO blocks VALUES (?, ?, ?, ?, ?)",
        [("v", rng.randrange(1 << 20), BLOCK, 0, rng.randrange(1 << 32)) for _ in range(rows)],
    )
    db.execute("COMMIT")


def durable_qd1(directory: Path) -> dict[str, float]:
    """Us per durable 4 KiB random write, per design (median of ROUNDS)."""
    fd = _file(directory / "data")
    journal = os.open(directory / "journal", os.O_RDWR | os.O_CREAT, 0o600)
    db = _sqlite(directory / "catalog.sqlite")
    data = os.urandom(BLOCK)
    rng = random.Random(1)
    log = pack_log_block(1, 1, 1, 8, write_record(1, 0, [(8, BLOCK, 0)]))

    def offset() -> int:
        return rng.randrange(FILE // BLOCK) * BLOCK

    def floor() -> None:
        os.pwrite(fd, data, offset())
        os.fdatasync(fd)

    def in_place() -> None:
        os.pwrite(fd, data, offset())
        os.fdatasync(fd)
        _commit_rows(db, rng, 1)

    def cow() -> None:
        os.pwrite(fd, data, offset())
        os.pwrite(fd, log, offset())
        os.fdatasync(fd)

    at = [0]

    def data_journal() -> None:
        os.pwrite(journal, data + log[:64], at[0])
        at[0] += BLOCK + 64
        os.fdatasync(journal)

    designs = {"pwrite+fdatasync": floor, "in place + SQLite": in_place, "copy-on-write": cow}
    designs["data journal (append)"] = data_journal
    found: dict[str, list[float]] = {name: [] for name in designs}
    for _ in range(ROUNDS):
        for name, one in designs.items():  # interleaved: the machine's noise hits all alike
            start = time.perf_counter()
            for _ in range(OPS):
                one()
            found[name].append((time.perf_counter() - start) / OPS * 1e6)
    os.close(fd)
    os.close(journal)
    db.close()
    return {name: statistics.median(times) for name, times in found.items()}


def metadata_commits(directory: Path) -> dict[str, float]:
    """Us per commit of 1 and 32 block records: SQLite against our log."""
    db = _sqlite(directory / "meta.sqlite")
    fd = _file(directory / "log")
    rng = random.Random(2)
    found: dict[str, list[float]] = {}
    for rows in (1, 32):
        entries = [(8 * i, BLOCK, rng.randrange(1 << 32)) for i in range(rows)]
        for _ in range(ROUNDS):
            start = time.perf_counter()
            for _ in range(OPS):
                _commit_rows(db, rng, rows)
            found.setdefault(f"SQLite, {rows} records", []).append(
                (time.perf_counter() - start) / OPS * 1e6
            )
            start = time.perf_counter()
            for i in range(OPS):
                block = pack_log_block(1, 1, i, 8, write_record(1, 0, entries))
                os.pwrite(fd, block, rng.randrange(FILE // BLOCK) * BLOCK)
                os.fdatasync(fd)
            found.setdefault(f"log, {rows} records", []).append(
                (time.perf_counter() - start) / OPS * 1e6
            )
    db.close()
    os.close(fd)
    return {name: statistics.median(times) for name, times in found.items()}


def write_amplification() -> dict[str, tuple[float, float]]:
    """Bytes written per 4 KiB written, (group of 1, group of 32), by the designs' rules."""
    record = 16  # bytes of one block's entry in a write record
    log_block = BLOCK  # a commit writes whole 4 KiB log blocks
    found = {}
    for name, per_block, per_commit in (
        ("copy-on-write", BLOCK, log_block),
        ("data journal", 2 * BLOCK + record, 0),  # journal, then the block in place
        ("in place + SQLite WAL", BLOCK, 2 * BLOCK),  # a WAL page and the header, at least
    ):
        found[name] = tuple((per_block * n + per_commit) / (BLOCK * n) for n in (1, 32))
    return found  # type: ignore[return-value]


def main() -> None:
    """Print the three tables."""
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        directory = Path(tmp)
        print("durable 4 KiB random write, QD1 (us, median of rounds):")
        for name, us in durable_qd1(directory).items():
            print(f"  {name:<28} {us:8.0f}")
        print("metadata commit incl. fdatasync (us):")
        for name, us in metadata_commits(directory).items():
            print(f"  {name:<28} {us:8.0f}")
    print("bytes written per 4 KiB block (group of 1 / of 32 per commit):")
    for name, (one, many) in write_amplification().items():
        print(f"  {name:<28} {one:5.2f} / {many:5.2f}")


if __name__ == "__main__":
    common.command_line(__doc__)
    main()

"""The memory backend holds at most its capacity: past it a write fails as on a full disk.

Thin volumes together may promise more than the capacity (as on the file backend);
what they hold may not. The write that finds no room fails with ResourceExhausted
("no space left ...", RESOURCE_EXHAUSTED on the wire), changes nothing (a
copy-on-write overwrite needs room too, and the old data stays), and a trim or a
delete gives the room back.
"""

from __future__ import annotations

import errno
import os
from typing import TYPE_CHECKING

import pytest

from dpu_agent.errors import InvalidArgument, ResourceExhausted
from dpu_agent.storage import DataServices, MemoryVolumeStore, memory_backend, open_store
from dpu_agent.storage.media import MemoryMedia

from .conftest import MiB

if TYPE_CHECKING:
    from pathlib import Path

CAPACITY = 8 * MiB
VOLUME = 6 * MiB  # two of them: 12 MiB promised
PIECE = 256 << 10
BLOCK = 4096
FULL = "no space left"


Written = dict[tuple[str, int], bytes]


def fill(store: MemoryVolumeStore, volume: str, start: int, step: int, data: Written) -> int:
    """Write `volume` from `start` in `step`-byte pieces until it is full; returns where."""
    for offset in range(start, VOLUME, step):
        piece = os.urandom(step)
        store.write(volume, offset, piece)
        data[volume, offset] = piece
    return VOLUME


def read_back(store: MemoryVolumeStore, data: Written) -> None:
    for (volume, offset), piece in data.items():
        assert store.read(volume, offset, len(piece)) == piece, f"{volume} at {offset} changed"


def test_memory_media_refuses_to_grow_past_its_capacity_and_writes_nothing():
    media = MemoryMedia(3 * BLOCK)
    pool, other = media.open("pool"), media.open("other")
    pool.pwrite(b"a" * BLOCK, 0)
    pool.pwrite(b"b" * BLOCK, BLOCK // 2)  # grows by half a block
    for write in (
        lambda: other.pwrite(bytes(2 * BLOCK), 0),
        lambda: pool.pwritev([b"c" * BLOCK, b"d" * BLOCK, b"e" * BLOCK], BLOCK // 2),
    ):
        with pytest.raises(OSError, match="capacity") as caught:
            write()
        assert caught.value.errno == errno.ENOSPC
    assert pool.pread(2 * BLOCK, 0) == b"a" * (BLOCK // 2) + b"b" * BLOCK + bytes(BLOCK // 2)
    assert (other.size(), media.held_bytes, media.free_bytes()) == (
        0,
        BLOCK * 3 // 2,
        BLOCK * 3 // 2,
    )
    pool.discard(0, BLOCK)  # zeros; the range stays held (the store reuses it)
    assert media.held_bytes == BLOCK * 3 // 2
    media.remove("pool")
    assert media.held_bytes == 0
    other.pwrite(bytes(3 * BLOCK), 0)
    assert media.free_bytes() == 0


def test_writes_past_the_capacity_fail_like_a_full_disk_and_trim_and_delete_free():
    data: Written = {}
    with MemoryVolumeStore(capacity_bytes=CAPACITY) as store:
        store.create("a", VOLUME, BLOCK, DataServices(crc32c=True))
        store.create("b", VOLUME, BLOCK, DataServices(crc32c=True))  # overcommitted
        fill(store, "a", 0, PIECE, data)
        with pytest.raises(ResourceExhausted, match=FULL):
            fill(store, "b", 0, PIECE, data)
        at = len([key for key in data if key[0] == "b"]) * PIECE
        with pytest.raises(ResourceExhausted, match=FULL):  # down to the last block
            fill(store, "b", at, BLOCK, data)
        at = max(offset for volume, offset in data if volume == "b") + BLOCK
        assert at < VOLUME, "the store never filled up"
        assert store.held_bytes <= CAPACITY

        old = store.read("a", 0, PIECE)
        with pytest.raises(ResourceExhausted, match=FULL):  # an overwrite needs room too
            store.write("a", 0, os.urandom(PIECE), fua=True)
        with pytest.raises(ResourceExhausted, match=FULL):
            store.write("a", PIECE - BLOCK, os.urandom(BLOCK))
        results = store.write_batch([("b", at, os.urandom(BLOCK)), ("a", 0, os.urandom(BLOCK))])
        assert [type(r) for r in results] == [ResourceExhausted, ResourceExhausted]
        assert store.read("a", 0, PIECE) == old, "a failed write changed the volume"
        read_back(store, data)

        store.trim("a", 0, MiB)  # gives 1 MiB back (some of it goes to the log)
        data = {key: piece for key, piece in data.items() if key[0] != "a" or key[1] >= MiB}
        for offset in range(at, at + MiB // 2, PIECE // 4):
            piece = os.urandom(PIECE // 4)
            store.write("b", offset, piece)
            data["b", offset] = piece
        at += MiB // 2

        store.delete("a")  # gives the rest back
        data = {key: piece for key, piece in data.items() if key[0] != "a"}
        fill(store, "b", at, BLOCK, data)
        store.flush("b")
        read_back(store, data)
        assert sum(len(p) for p in data.values()) == VOLUME
        assert store.held_bytes <= CAPACITY


def test_volumes_may_promise_more_than_the_capacity_but_one_must_fit_in_the_room():
    with MemoryVolumeStore(capacity_bytes=CAPACITY) as store:
        for name in ("a", "b", "c"):  # 18 MiB promised in 8 MiB: thin, as on a disk
            store.create(name, VOLUME, BLOCK, DataServices())
        with pytest.raises(ResourceExhausted, match=r"volume of \d+ bytes does not fit"):
            store.create("d", CAPACITY + MiB, BLOCK, DataServices())
        store.write("a", 0, os.urandom(VOLUME))
        with pytest.raises(ResourceExhausted, match="does not fit"):  # less room left now
            store.resize("b", 2 * VOLUME)


def test_the_default_capacity_is_half_the_memory_available(monkeypatch):
    monkeypatch.setattr(memory_backend, "memory_limits", lambda: (1 << 34, 1 << 30))
    with MemoryVolumeStore() as store:
        assert store.capacity_bytes == 1 << 29
    with open_store("memory") as store:
        assert isinstance(store, MemoryVolumeStore)
        assert store.capacity_bytes == 1 << 29


@pytest.mark.parametrize("capacity", [0, -1])
def test_a_capacity_that_is_not_positive_is_refused(capacity):
    with pytest.raises(InvalidArgument, match="not positive"):
        MemoryVolumeStore(capacity_bytes=capacity)


def test_open_store_refuses_a_capacity_beyond_the_memory_this_process_may_use():
    total = memory_backend.memory_limits()[0]
    with pytest.raises(InvalidArgument, match=f"more than the {total} bytes of memory"):
        open_store("memory", memory_capacity_bytes=total + 1)
    with pytest.raises(InvalidArgument, match="negative"):
        open_store("memory", memory_capacity_bytes=-1)
    with open_store("memory", memory_capacity_bytes=CAPACITY) as store:
        assert isinstance(store, MemoryVolumeStore)
        assert store.capacity_bytes == CAPACITY


MEMINFO = "MemTotal:       16384000 kB\nMemFree:         1000 kB\nMemAvailable:    8192000 kB\n"


def fake_host(tmp_path: Path, cgroup: str, files: dict[str, str]) -> tuple[Path, Path]:
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(MEMINFO)
    (proc / "self" / "cgroup").write_text(cgroup)
    cgroups.mkdir()
    for name, text in files.items():
        (cgroups / name).parent.mkdir(parents=True, exist_ok=True)
        (cgroups / name).write_text(text)
    return proc, cgroups


@pytest.mark.parametrize(
    ("cgroup", "files", "expected"),
    [
        ("0::/\n", {}, (16384000 * 1024, 8192000 * 1024)),
        (  # v2: the tightest of the cgroup and those above it
            "0::/pod/agent\n",
            {
                "pod/agent/memory.max": "max\n",
                "pod/agent/memory.current": "100\n",
                "pod/memory.max": f"{1 << 30}\n",
                "pod/memory.current": f"{1 << 28}\n",
            },
            (1 << 30, (1 << 30) - (1 << 28)),
        ),
        (  # v1 (hybrid: the unified hierarchy has no memory controller)
            "4:memory:/agent\n1:cpu:/\n0::/\n",
            {
                "memory/agent/memory.limit_in_bytes": f"{1 << 31}\n",
                "memory/agent/memory.usage_in_bytes": f"{1 << 30}\n",
                "memory/memory.limit_in_bytes": "9223372036854771712\n",
                "memory/memory.usage_in_bytes": "5\n",
            },
            (1 << 31, 1 << 30),
        ),
        (  # a namespaced view: the path is the host's, the mount the container's own
            "0::/host/path/agent\n",
            {"memory.max": f"{1 << 32}\n", "memory.current": f"{1 << 29}\n"},
            (1 << 32, min(8192000 * 1024, (1 << 32) - (1 << 29))),
        ),
    ],
    ids=["no-limit", "v2", "v1", "namespaced"],
)
def test_memory_limits_read_meminfo_and_every_memory_cgroup_above(
    tmp_path, cgroup, files, expected
):
    proc, cgroups = fake_host(tmp_path, cgroup, files)
    assert memory_backend.memory_limits(proc, cgroups) == expected

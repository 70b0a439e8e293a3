"""Freed space is discarded before anything may be written there again.

A trim or a delete frees blocks; once the change is durable the store gives their
chunks back to the file system (`discard`: a punched hole, or zeros). That call runs
without the store's lock. If the chunk were allocatable before it, a write running
meanwhile could put its data there and the late discard would zero it: a block that
reads as zeros (or, after a crash, as an older version) though its write returned.
The power-cut torture's rare failure had that signature (seed 1408016313, cut 87: a
snapshot's blocks 27 and 29 read older versions, block 28 did not, as when a zeroing
of the chunk the three 512-byte blocks shared is torn by the cut).
"""

from __future__ import annotations

import threading

from dpu_agent.storage import DataServices
from dpu_agent.storage.engine import POOL, CowVolumeStore
from dpu_agent.storage.keys import KeySealer
from dpu_agent.storage.layout import CHUNK
from dpu_agent.storage.media import MemoryMedia

WRITES = 200  # more than the free chunks with file space a fresh store keeps (63)


def test_a_write_running_while_freed_space_is_discarded_keeps_its_data():
    media = MemoryMedia()
    pool = media.open(POOL)
    discard = pool.discard
    held = threading.Event()
    resume = threading.Event()

    def slow_discard(offset: int, length: int) -> None:
        if not held.is_set():  # the first discard: the test's trim
            held.set()
            assert resume.wait(10)
        discard(offset, length)

    with CowVolumeStore(media, KeySealer(bytes(32))) as store:
        store.create("v", (WRITES + 1) * CHUNK, CHUNK, DataServices(crc32c=True))
        store.write("v", 0, b"\x01" * CHUNK, fua=True)
        freed = store.physical("v", 0)
        assert freed is not None
        pool.discard = slow_discard  # type: ignore[method-assign]
        trim = threading.Thread(target=store.trim, args=("v", 0, CHUNK))
        trim.start()
        try:
            assert held.wait(10), "the trim never discarded its block"
            landed = []
            for block in range(1, WRITES + 1):
                store.write("v", block * CHUNK, block.to_bytes(2, "little") * (CHUNK // 2))
                if store.physical("v", block * CHUNK) == freed:
                    landed.append(block)
        finally:
            resume.set()
            trim.join(10)
        assert not trim.is_alive()
        store.commit()
        for block in range(1, WRITES + 1):
            got = store.read("v", block * CHUNK, CHUNK)
            assert got == block.to_bytes(2, "little") * (CHUNK // 2), (
                f"block {block} lost its data (it was written where the trim's discard "
                f"was pending: {landed})"
            )
        assert store.read("v", 0, CHUNK) == bytes(CHUNK)

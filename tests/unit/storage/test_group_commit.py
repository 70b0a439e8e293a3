"""Group commit: concurrent FUA writes and flushes share syncs; nothing waits on a sync it
does not need (the store's lock is never held across one)."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from dpu_agent.storage import DataServices
from dpu_agent.storage.engine import CowVolumeStore
from dpu_agent.storage.keys import KeySealer
from dpu_agent.storage.media import MemoryFile, MemoryMedia

from .conftest import MiB


class GatedFile(MemoryFile):
    """A file whose sync waits until the test opens the gate (or a delay passes)."""

    def __init__(self, media: "GatedMedia") -> None:
        super().__init__()
        self.media = media

    def sync(self) -> None:
        self.media.syncs += 1
        self.media.in_sync.set()
        self.media.gate.wait(self.media.delay)


class GatedMedia(MemoryMedia):
    def __init__(self, delay: float | None = None) -> None:
        super().__init__()
        self.delay = delay
        self.gate = threading.Event()
        self.in_sync = threading.Event()
        self.syncs = 0

    def open(self, name: str) -> MemoryFile:
        with self._lock:
            return self._files.setdefault(name, GatedFile(self))


def gated_store(media: GatedMedia) -> CowVolumeStore:
    media.gate.set()  # formatting syncs freely
    store = CowVolumeStore(media, KeySealer(bytes(32)))
    store.create("v", MiB, 4096, DataServices(crc32c=True))
    store.commit()
    media.gate.clear()
    return store


def test_concurrent_fua_writes_and_flushes_share_syncs():
    media = GatedMedia(delay=0.02)  # every sync takes 20 ms
    with gated_store(media) as store:
        before = store._journal.commits
        rounds = threading.Barrier(16)  # the 16 callers of a round arrive together

        def work(k: int) -> None:
            for i in range(4):
                rounds.wait(10)
                store.write("v", (k * 4 + i) * 4096, bytes([k]) * 4096, fua=i % 2 == 0)
                if i % 2:
                    store.flush("v")

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(work, range(16)))
        commits = store._journal.commits - before
        assert commits <= 16, f"64 durable calls took {commits} commits"
        media.gate.set()
        assert store.read("v", 0, 64 * 4096) == b"".join(bytes([k]) * 4 * 4096 for k in range(16))


def test_a_sync_in_progress_blocks_no_other_write_or_read():
    media = GatedMedia()  # syncs wait for the gate
    with gated_store(media) as store:
        store.write("v", 0, b"a" * 4096)
        fua = threading.Thread(
            target=store.write, args=("v", 4096, b"f" * 4096), kwargs={"fua": True}
        )
        fua.start()
        assert media.in_sync.wait(10), "the FUA write never synced"
        done = threading.Event()

        def others() -> None:  # while that sync hangs
            store.write("v", 8192, b"b" * 4096)
            assert store.read("v", 0, 4096) == b"a" * 4096
            done.set()

        other = threading.Thread(target=others)
        other.start()
        started = time.monotonic()
        while not done.is_set() and time.monotonic() - started < 10:
            time.sleep(0.01)
        finished = done.is_set()
        media.gate.set()
        fua.join(10)
        other.join(10)
        assert finished, "a plain write or a read waited for someone else's sync"
        assert store.read("v", 0, 12288) == b"a" * 4096 + b"f" * 4096 + b"b" * 4096

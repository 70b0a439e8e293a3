"""What only the file backend has: restart, crash, on-disk damage, layout, the master key."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dpu_agent.errors import FailedPrecondition
from dpu_agent.storage import (
    Compression,
    DataCorruption,
    DataServices,
    Encryption,
    FileVolumeStore,
    checkpoint,
    media,
)

from .conftest import ALL_SERVICES, MiB, flip_stored_byte
from .test_io import mixed_data

REPO = Path(__file__).resolve().parents[3]


def test_volumes_settings_and_data_survive_a_restart(tmp_path):
    expected = {}
    with FileVolumeStore(tmp_path, max_volume_bytes=4 * MiB) as store:
        for i, services in enumerate(ALL_SERVICES):
            v = f"v{i}"
            info = store.create(v, 2 * MiB, 512 if i % 2 else 4096, services)
            data = mixed_data(MiB, i)
            store.write(v, MiB, data)  # not flushed: close() flushes
            expected[v] = (info, data)
        store.resize("v0", 4 * MiB)
        expected["v0"] = (store.get("v0"), expected["v0"][1])
    with FileVolumeStore(tmp_path) as store:
        assert store.list() == [
            info for info, _ in sorted(expected.values(), key=lambda e: e[0].volume_id)
        ]
        for v, (info, data) in expected.items():
            assert store.get(v) == info
            assert store.read(v, 0, info.size_bytes) == bytes(MiB) + data + bytes(
                info.size_bytes - 2 * MiB
            )


WRITER = textwrap.dedent(
    """
    import json, sys
    from dpu_agent.storage import Compression, DataServices, Encryption, FileVolumeStore
    from tests.unit.storage.test_io import mixed_data

    store = FileVolumeStore(sys.argv[1])
    volumes = {
        "a": (4096, DataServices(True, Compression.ZSTD, Encryption.AES_XTS_256)),
        "b": (512, DataServices(True, Compression.LZ4, Encryption.NONE)),
        "c": (4096, DataServices(False, Compression.NONE, Encryption.AES_XTS_256)),
    }
    for v, (bs, services) in volumes.items():
        info = store.create(v, 4 << 20, bs, services)
        print("volume", json.dumps([v, info.size_bytes, bs, info.create_ns]), flush=True)
    for i in range(240):
        v = "abc"[i % 3]
        offset = (i // 3) * 16384
        data = mixed_data(16384, i)
        if i % 2:
            store.write(v, offset, data)
            store.flush(v)
        else:
            store.write(v, offset, data, fua=True)
        print("acknowledged", i, flush=True)
    print("done", flush=True)
    sys.stdin.read()  # wait to be killed
    """
)


@pytest.mark.parametrize("kill_after", [45, 240])
def test_acknowledged_writes_survive_sigkill(tmp_path, kill_after):
    """The writer is SIGKILLed (no close, no atexit) after `kill_after` acknowledgements,
    while it is still writing; a new store sees every acknowledged byte."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    created = {}
    acked = set()
    try:
        for line in proc.stdout:
            word, _, rest = line.strip().partition(" ")
            if word == "volume":
                v, size, bs, create_ns = json.loads(rest)
                created[v] = (size, bs, create_ns)
            elif word == "acknowledged":
                acked.add(int(rest))
                if len(acked) >= kill_after:
                    break
            elif word == "done":
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        assert proc.stdin is not None
        proc.stdin.close()
    assert proc.returncode == -signal.SIGKILL
    assert len(acked) == kill_after
    with FileVolumeStore(tmp_path) as store:
        infos = {info.volume_id: info for info in store.list()}
        assert {v: (i.size_bytes, i.block_size, i.create_ns) for v, i in infos.items()} == created
        assert infos["a"].services == DataServices(True, Compression.ZSTD, Encryption.AES_XTS_256)
        for i in range(240):
            v, offset = "abc"[i % 3], (i // 3) * 16384
            got = store.read(v, offset, 16384)
            if i in acked:
                assert got == mixed_data(16384, i), i
            else:  # in flight or never written: all or nothing of the blocks, no garbage
                for at in range(0, 16384, infos[v].block_size):
                    block = got[at : at + infos[v].block_size]
                    assert block in {bytes(len(block)), mixed_data(16384, i)[at : at + len(block)]}


def test_flipped_byte_in_the_pool_is_data_corruption(tmp_path, caplog):
    with FileVolumeStore(tmp_path) as store:
        store.create("v", MiB, 4096, DataServices(crc32c=True))
        data = os.urandom(8192)
        store.write("v", 0, data, fua=True)
        where = store.physical("v", 4096)
    assert where is not None
    with (tmp_path / "pool").open("r+b") as f:
        f.seek(where[0] + 100)
        byte = f.read(1)
        f.seek(where[0] + 100)
        f.write(bytes([byte[0] ^ 1]))
    with FileVolumeStore(tmp_path) as store:
        assert store.read("v", 0, 4096) == data[:4096]
        with pytest.raises(DataCorruption, match="volume 'v': block 1 failed its CRC32C check"):
            store.read("v", 0, 8192)
        assert store.stats("v").errors == 1
    assert "data corruption" in caplog.text


def test_plain_writes_are_durable_after_a_flush_and_committed_in_the_background(tmp_path):
    with FileVolumeStore(tmp_path) as store:
        store.create("v", MiB, 4096, DataServices(crc32c=True))
        journal = store._journal
        store.write("v", 0, b"a" * 8192)
        assert journal.durable < journal.appended  # not yet
        store.flush("v")
        assert journal.durable == journal.appended
        store.write("v", 8192, b"b" * 4096, fua=True)
        assert journal.durable == journal.appended
        store.write("v", 0, b"c" * 4096)
        deadline = time.monotonic() + 30
        while journal.durable < journal.appended:  # the journal's thread commits it
            assert time.monotonic() < deadline, "a plain write was never committed"
            time.sleep(0.05)


def test_files_are_private(tmp_path):
    with FileVolumeStore(tmp_path / "s") as store:
        store.create("v", MiB, 4096, DataServices())
        store.write("v", 0, bytes(4096), fua=True)
        modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "s").rglob("*")}
    assert modes == dict.fromkeys(
        ["master.key", "store.lock", "pool", "checkpoint.0", "checkpoint.1"], 0o600
    )
    assert (tmp_path / "s").stat().st_mode & 0o777 == 0o700


def allocated(path: Path) -> int:
    return path.stat().st_blocks * 512


@pytest.mark.parametrize("block_size", [512, 4096])
def test_the_pool_is_sparse_and_trim_and_delete_give_space_back(tmp_path, block_size):
    pool = tmp_path / "pool"
    with FileVolumeStore(tmp_path) as store:
        store.create("v", 64 * MiB, block_size, DataServices(crc32c=True))
        assert allocated(pool) < MiB
        store.write("v", 0, os.urandom(4 * MiB), fua=True)
        full = allocated(pool)
        assert full >= 4 * MiB
        store.trim("v", 0, 3 * MiB)
        store.commit()  # the freed blocks leave limbo after the next commit
        assert allocated(pool) < full - 2 * MiB
        assert store.read("v", 0, 3 * MiB) == bytes(3 * MiB)
        store.delete("v")
        store.commit()
        assert allocated(pool) < MiB


def test_trim_writes_zeros_where_holes_cannot_be_punched(tmp_path, monkeypatch):
    monkeypatch.setattr(media, "_fallocate", None)
    with FileVolumeStore(tmp_path) as store:
        store.create("v", MiB, 4096, DataServices())
        store.write("v", 0, b"\xff" * MiB, fua=True)
        where = [store.physical("v", offset) for offset in range(0, MiB, 4096)]
        store.trim("v", 4096, 3 * MiB // 4)
        store.commit()
        raw = (tmp_path / "pool").read_bytes()
        for i, found in enumerate(where):
            assert found is not None
            trimmed = 1 <= i < 1 + 3 * MiB // 4 // 4096
            block = raw[found[0] : found[0] + 4096]
            assert block == (bytes(4096) if trimmed else b"\xff" * 4096), i


def test_overwrites_go_to_new_places_and_the_old_data_stays_until_durable(tmp_path):
    with FileVolumeStore(tmp_path) as store:
        store.create("v", MiB, 4096, DataServices())
        store.write("v", 0, b"o" * 4096, fua=True)
        old = store.physical("v", 0)
        store.write("v", 0, b"n" * 4096)
        new = store.physical("v", 0)
        assert old is not None
        assert new is not None
        assert new[0] != old[0]
        assert store._pool.pread(4096, old[0]) == b"o" * 4096  # not durable: the old stays
        store.flush("v")
        store.write("v", 4096, b"x" * 4096)  # may now reuse the old place
        assert store.read("v", 0, 8192) == b"n" * 4096 + b"x" * 4096


def test_free_space_comes_from_the_disk(tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)._replace(free=2 * MiB)
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: usage)
    with FileVolumeStore(tmp_path) as store:
        store.create("v", 2 * MiB, 4096, DataServices())
        with pytest.raises(Exception, match=f"volume of {3 * MiB} bytes does not fit"):
            store.create("w", 3 * MiB, 4096, DataServices())


def test_one_store_per_directory(tmp_path):
    with (
        FileVolumeStore(tmp_path),
        pytest.raises(FailedPrecondition, match="open in another store or process"),
    ):
        FileVolumeStore(tmp_path)
    with FileVolumeStore(tmp_path) as store:
        assert store.list() == []


def test_checkpoints_rotate_between_two_slots(tmp_path):
    """Checkpoints alternate slots; the store opens from the newer one alone.

    (A checkpoint torn while being written falls back to the other slot: the crash
    tests in tests/torture cut the power during checkpoint writes.)
    """
    expected = {}
    with FileVolumeStore(tmp_path, checkpoint_log_bytes=1) as store:
        for i in range(40):
            v = f"v{i % 4}"
            if i < 4:
                store.create(v, MiB, 4096, DataServices(crc32c=True))
            data = os.urandom(4096)
            store.write(v, (i // 4) * 4096, data, fua=True)
            expected[v, (i // 4) * 4096] = data
        store.checkpoint()
        store.checkpoint()
        assert store._journal.checkpoints >= 3
        number = store._ckpt_number
    older = tmp_path / checkpoint.SLOTS[(number + 1) % 2]
    older.write_bytes(os.urandom(older.stat().st_size))
    with FileVolumeStore(tmp_path) as store:
        for (v, offset), data in expected.items():
            assert store.read(v, offset, 4096) == data


def test_a_damaged_pool_header_is_not_formatted_over(tmp_path):
    with FileVolumeStore(tmp_path) as store:
        store.create("v", MiB, 4096, DataServices())
        store.write("v", 0, b"k" * 4096, fua=True)
    with (tmp_path / "pool").open("r+b") as f:
        f.write(b"garbage!")
    with pytest.raises(DataCorruption, match="refusing to format over them"):
        FileVolumeStore(tmp_path)
    (tmp_path / "pool").unlink()
    with pytest.raises(DataCorruption, match="refusing to format over them"):
        FileVolumeStore(tmp_path)


def test_a_store_whose_format_was_interrupted_is_formatted_again(tmp_path):
    FileVolumeStore(tmp_path).close()
    with (tmp_path / "pool").open("r+b") as f:
        f.write(bytes(16))  # the header is written last: as if the format never finished
    with FileVolumeStore(tmp_path) as store:
        assert store.list() == []
        store.create("v", MiB, 4096, DataServices())


def test_no_checkpoint_is_data_corruption(tmp_path):
    FileVolumeStore(tmp_path).close()
    for name in checkpoint.SLOTS:
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(DataCorruption, match="no valid checkpoint"):
        FileVolumeStore(tmp_path)


def test_delete_gives_the_id_back_and_survives_a_restart(tmp_path):
    with FileVolumeStore(tmp_path) as store:
        store.create("v", MiB, 4096, DataServices(crc32c=True))
        store.write("v", 0, os.urandom(MiB), fua=True)
        store.delete("v")
        assert store.list() == []
    with FileVolumeStore(tmp_path) as store:
        assert store.list() == []
        store.create("v", MiB, 4096, DataServices(crc32c=True))
        assert store.read("v", 0, MiB) == bytes(MiB)


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: p.chmod(0o644), r"may be accessed by group or others \(mode 0644\)"),
        (lambda p: p.write_bytes(b"short"), "does not hold a 32-byte master key"),
    ],
)
def test_bad_master_key_file_is_refused(tmp_path, setup, message):
    FileVolumeStore(tmp_path).close()
    setup(tmp_path / "master.key")
    with pytest.raises(FailedPrecondition, match=message):
        FileVolumeStore(tmp_path)
    with pytest.raises(FailedPrecondition, match=message):  # and the lock was released
        FileVolumeStore(tmp_path)


def test_another_master_key_cannot_open_the_volume_keys(tmp_path):
    with FileVolumeStore(tmp_path) as store:
        store.create("enc", MiB, 4096, DataServices(encryption=Encryption.AES_XTS_256))
        store.create("plain", MiB, 4096, DataServices())
        store.write("enc", 0, b"s" * 4096)
        store.write("plain", 0, b"p" * 4096)
    (tmp_path / "master.key").write_bytes(os.urandom(32))
    with FileVolumeStore(tmp_path) as store:
        with pytest.raises(DataCorruption, match="'enc': its key cannot be unsealed"):
            store.read("enc", 0, 4096)
        assert store.read("plain", 0, 4096) == b"p" * 4096


def test_sealed_key_is_bound_to_its_volume(tmp_path):
    with FileVolumeStore(tmp_path) as store:
        for v in ("a", "b"):
            store.create(v, MiB, 4096, DataServices(encryption=Encryption.AES_XTS_256))
        nodes = store._state.volumes
        nodes["b"].sealed_key = nodes["a"].sealed_key  # as if it were copied on disk
        store._volumes["b"].key = store._volumes["b"].codec = None
        with pytest.raises(DataCorruption, match="'b'"):
            store.read("b", 0, 4096)


def test_damage_helper_hits_the_file(tmp_path):
    with FileVolumeStore(tmp_path) as store:
        store.create("v", MiB, 4096, DataServices(crc32c=True))
        store.write("v", 0, bytes(4096))
        flip_stored_byte(store, "v", 0)
        with pytest.raises(DataCorruption):
            store.read("v", 0, 4096)


def test_a_pool_with_data_and_no_checkpoint_is_not_formatted_over(tmp_path):
    with FileVolumeStore(tmp_path) as store:
        store.create("v", MiB, 4096, DataServices())
        store.write("v", 0, b"k" * 4096, fua=True)
    with (tmp_path / "pool").open("r+b") as f:
        f.write(b"garbage!")
    for name in checkpoint.SLOTS:
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(DataCorruption, match="refusing to format over them"):
        FileVolumeStore(tmp_path)


def test_a_crash_while_the_master_key_is_created_leaves_a_store_that_opens(tmp_path, monkeypatch):
    # The key was created in place (O_EXCL, then the write): an agent that died (or a
    # power cut that came) between the two left an empty master.key, and every later
    # start was refused ("does not hold a 32-byte master key") until someone removed it.
    real_write = os.write

    def die_writing_the_key(fd, data):
        if len(data) == 32:
            raise KeyboardInterrupt("killed while writing the master key")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", die_writing_the_key)
    with pytest.raises(KeyboardInterrupt):
        FileVolumeStore(tmp_path / "s")
    monkeypatch.undo()
    with FileVolumeStore(tmp_path / "s") as store:
        store.create("v", MiB, 4096, DataServices(encryption=Encryption.AES_XTS_256))
        store.write("v", 0, b"k" * 4096, fua=True)
    with FileVolumeStore(tmp_path / "s") as store:
        assert store.read("v", 0, 4096) == b"k" * 4096
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == [
        "checkpoint.0",
        "checkpoint.1",
        "master.key",
        "pool",
        "store.lock",
    ]

"""What only the file backend has: restart, crash, on-disk damage, layout, the master key."""

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dpu_agent.errors import FailedPrecondition
from dpu_agent.storage import (
    Compression,
    DataCorruption,
    DataServices,
    Encryption,
    FileVolumeStore,
    blockstore,
    file_backend,
)
from dpu_agent.storage.file_backend import SqliteCatalog

from .conftest import ALL_SERVICES, MiB, flip_stored_byte
from .test_io import mixed_data

REPO = Path(__file__).resolve().parents[3]


def catalog(store: FileVolumeStore) -> SqliteCatalog:
    assert isinstance(store._catalog, SqliteCatalog)
    return store._catalog


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


def test_flipped_byte_in_the_volume_file_is_data_corruption(tmp_path, caplog):
    with FileVolumeStore(tmp_path) as store:
        store.create("v", MiB, 4096, DataServices(crc32c=True))
        data = os.urandom(8192)
        store.write("v", 0, data, fua=True)
    with (tmp_path / "volumes" / "v.vol").open("r+b") as f:
        f.seek(4096 + 100)
        byte = f.read(1)
        f.seek(4096 + 100)
        f.write(bytes([byte[0] ^ 1]))
    with FileVolumeStore(tmp_path) as store:
        assert store.read("v", 0, 4096) == data[:4096]
        with pytest.raises(DataCorruption, match="volume 'v': block 1 failed its CRC32C check"):
            store.read("v", 0, 8192)
        assert store.stats("v").errors == 1
    assert "data corruption" in caplog.text


def test_damaged_catalog_record_is_data_corruption(tmp_path):
    with FileVolumeStore(tmp_path) as store:
        store.create("v", MiB, 4096, DataServices(True, Compression.LZ4))
        store.write("v", 0, bytes(4096), fua=True)
    with sqlite3.connect(tmp_path / "catalog.sqlite") as db:
        db.execute("UPDATE blocks SET crc = crc + 1")
    db.close()
    with FileVolumeStore(tmp_path) as store, pytest.raises(DataCorruption, match="block 0"):
        store.read("v", 0, 4096)


def test_unflushed_writes_stay_out_of_the_catalog_until_flushed(tmp_path):
    with FileVolumeStore(tmp_path) as store:
        store.create("v", MiB, 4096, DataServices(crc32c=True))
        store.write("v", 0, b"a" * 8192)
        count = "SELECT count(*) FROM blocks"
        assert catalog(store)._query(count, ())[0][0] == 0
        store.flush("v")
        assert catalog(store)._query(count, ())[0][0] == 2
        store.write("v", 8192, b"b" * 4096, fua=True)
        assert catalog(store)._query(count, ())[0][0] == 3


def test_catalog_uses_wal_and_full_sync(tmp_path):
    with FileVolumeStore(tmp_path) as store:
        assert catalog(store)._query("PRAGMA synchronous", ())[0][0] == 2  # FULL
        assert catalog(store)._query("PRAGMA journal_mode", ())[0][0] == "wal"


def test_files_are_private(tmp_path):
    with FileVolumeStore(tmp_path / "s") as store:
        store.create("v", MiB, 4096, DataServices())
        store.write("v", 0, bytes(4096), fua=True)
        modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "s").rglob("*")}
    assert modes["master.key"] == 0o600
    assert modes["catalog.sqlite"] == 0o600
    assert modes["v.vol"] == 0o600
    assert (tmp_path / "s").stat().st_mode & 0o777 == 0o700


def test_volume_file_is_sparse_and_trim_punches_holes(tmp_path):
    with FileVolumeStore(tmp_path) as store:
        store.create("v", 8 * MiB, 4096, DataServices(crc32c=True))
        path = tmp_path / "volumes" / "v.vol"
        assert path.stat().st_size == 8 * MiB
        assert path.stat().st_blocks * 512 < MiB
        store.write("v", 0, os.urandom(4 * MiB), fua=True)
        allocated = path.stat().st_blocks * 512
        assert allocated >= 4 * MiB
        store.trim("v", 0, 4 * MiB)
        assert path.stat().st_blocks * 512 < allocated - 3 * MiB
        assert store.read("v", 0, 4 * MiB) == bytes(4 * MiB)


def test_trim_writes_zeros_where_holes_cannot_be_punched(tmp_path, monkeypatch):
    monkeypatch.setattr(file_backend, "_fallocate", None)
    with FileVolumeStore(tmp_path) as store:
        store.create("v", MiB, 4096, DataServices())
        store.write("v", 0, b"\xff" * MiB, fua=True)
        store.trim("v", 4096, 3 * MiB // 4)
        raw = (tmp_path / "volumes" / "v.vol").read_bytes()
        assert raw[4096 : 4096 + 3 * MiB // 4] == bytes(3 * MiB // 4)
        assert raw[:4096] == b"\xff" * 4096


def test_free_space_comes_from_the_disk(tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)._replace(free=2 * MiB)
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: usage)
    with FileVolumeStore(tmp_path) as store:
        store.create("v", 2 * MiB, 4096, DataServices())
        with pytest.raises(
            Exception, match=f"volume of {3 * MiB} bytes does not fit: {2 * MiB} bytes free"
        ):
            store.create("w", 3 * MiB, 4096, DataServices())


def test_one_store_per_directory(tmp_path):
    with (
        FileVolumeStore(tmp_path),
        pytest.raises(FailedPrecondition, match="open in another store or process"),
    ):
        FileVolumeStore(tmp_path)
    with FileVolumeStore(tmp_path) as store:
        assert store.list() == []


def test_leftovers_of_a_crash_are_repaired_on_open(tmp_path):
    with FileVolumeStore(tmp_path) as store:
        store.create("v", MiB, 4096, DataServices(crc32c=True))
        store.write("v", 0, b"k" * 4096, fua=True)
    ghost = tmp_path / "volumes" / "ghost.vol"  # a create that never reached the catalog
    ghost.write_bytes(b"x")
    os.truncate(tmp_path / "volumes" / "v.vol", 3 * MiB)  # a resize that never did
    with FileVolumeStore(tmp_path) as store:
        assert not ghost.exists()
        assert store.read("v", 0, 4096) == b"k" * 4096
        assert (tmp_path / "volumes" / "v.vol").stat().st_size == MiB


def test_missing_volume_file_is_data_corruption_not_zeros(tmp_path):
    with FileVolumeStore(tmp_path) as store:
        store.create("v", MiB, 4096, DataServices())
    (tmp_path / "volumes" / "v.vol").unlink()
    with FileVolumeStore(tmp_path) as store:
        with pytest.raises(DataCorruption, match="its data file is missing"):
            store.read("v", 0, 4096)
        store.delete("v")
        assert store.list() == []


def test_delete_removes_file_and_records(tmp_path):
    with FileVolumeStore(tmp_path) as store:
        store.create("v", MiB, 4096, DataServices(crc32c=True))
        store.write("v", 0, os.urandom(MiB), fua=True)
        store.delete("v")
        assert not (tmp_path / "volumes" / "v.vol").exists()
        assert catalog(store)._query("SELECT count(*) FROM blocks", ())[0][0] == 0
    with FileVolumeStore(tmp_path) as store:
        assert store.list() == []


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
    with sqlite3.connect(tmp_path / "catalog.sqlite") as db:
        (sealed,) = db.execute("SELECT sealed_key FROM volumes WHERE volume_id = 'a'").fetchone()
        db.execute("UPDATE volumes SET sealed_key = ? WHERE volume_id = 'b'", (sealed,))
    db.close()
    with FileVolumeStore(tmp_path) as store, pytest.raises(DataCorruption, match="'b'"):
        store.read("b", 0, 4096)


def test_damage_helper_hits_the_file(tmp_path):
    with FileVolumeStore(tmp_path) as store:
        store.create("v", MiB, 4096, DataServices(crc32c=True))
        store.write("v", 0, bytes(4096))
        flip_stored_byte(store, "v", 0)
        with pytest.raises(DataCorruption):
            store.read("v", 0, 4096)


def test_many_unflushed_writes_are_committed_in_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(blockstore, "MAX_PENDING_RECORDS", 4)
    with FileVolumeStore(tmp_path) as store:
        store.create("v", MiB, 4096, DataServices(crc32c=True))
        store.write("v", 0, bytes(3 * 4096))
        assert catalog(store)._query("SELECT count(*) FROM blocks", ())[0][0] == 0
        store.write("v", 3 * 4096, bytes(4096))
        assert catalog(store)._query("SELECT count(*) FROM blocks", ())[0][0] == 4
        assert store._volumes["v"].pending == {}

"""A store of the format before engine v2 opens with the new engine and reads back unchanged."""

import os

import pytest

from dpu_agent.storage import DataCorruption, DataServices, FileVolumeStore
from dpu_agent.storage import engine as engine_module

from .conftest import ALL_SERVICES, MiB
from .legacy_format import LegacyWriter
from .test_io import mixed_data


def old_store(path, *, version=2):
    """Every data-service combination, both block sizes, partly written; what it holds."""
    writer = LegacyWriter(path, version=version)
    expected = {}
    for i, services in enumerate(ALL_SERVICES):
        for bs in (512, 4096):
            v = f"v{i}-{bs}"
            size = 2 * MiB
            writer.volume(
                v,
                size,
                bs,
                services,
                tenant="default" if version == 1 else f"tenant-{i % 3}",
                create_ns=1_700_000_000_000_000_000 + i,
                update_ns=1_700_000_000_000_000_500 + i,
            )
            data = bytearray(size)
            for n, offset in enumerate((0, 64 << 10, MiB + 8192, size - 16384)):
                chunk = mixed_data(16384, i * 10 + n)
                writer.write(v, offset, chunk)
                data[offset : offset + len(chunk)] = chunk
            writer.write(v, 0, os.urandom(bs))  # an overwrite in place, as the old store did
            data[:bs] = open_block(writer, v, 0)
            expected[v] = (services, bs, size, bytes(data), f"tenant-{i % 3}")
    writer.close()
    return expected


def open_block(writer, v, block):
    """What block `block` of `v` holds (decoded), read back from the old layout."""
    codec, bs = writer.codecs[v], writer.block_sizes[v]
    raw = (writer.directory / "volumes" / f"{v}.vol").read_bytes()[block * bs : (block + 1) * bs]
    row = writer_row(writer, v, block)
    if codec.transparent:
        return raw
    from dpu_agent.storage.dataservices import BlockRecord  # noqa: PLC0415

    return bytes(codec.decode(block, memoryview(raw), BlockRecord(*row)))


def writer_row(writer, v, block):
    return writer.db.execute(
        "SELECT length, flags, crc FROM blocks WHERE volume_id = ? AND block = ?", (v, block)
    ).fetchone()


@pytest.mark.parametrize("version", [1, 2])
def test_an_old_store_opens_and_reads_back_unchanged(tmp_path, version):
    store_dir = tmp_path / "store"
    expected = old_store(store_dir, version=version)
    with FileVolumeStore(store_dir) as store:
        infos = {info.volume_id: info for info in store.list()}
        assert set(infos) == set(expected)
        for v, (services, bs, size, data, tenant) in expected.items():
            info = infos[v]
            assert (info.services, info.block_size, info.size_bytes) == (services, bs, size)
            assert info.tenant == (tenant if version == 2 else "default")
            assert info.update_ns - info.create_ns == 500
            assert store.read(v, 0, size) == data, v
    names = {p.name for p in store_dir.iterdir()}
    assert "catalog.sqlite" not in names
    assert "volumes" not in names, "the old volume files stay after the upgrade"
    assert {"pool", "checkpoint.0", "checkpoint.1", "master.key"} <= names
    with FileVolumeStore(store_dir) as store:  # and again, from the new format alone
        for v, (_, _, size, data, _) in expected.items():
            assert store.read(v, 0, size) == data
        store.write("v0-4096", 0, b"n" * 4096, fua=True)
        assert store.read("v0-4096", 0, 4096) == b"n" * 4096


def test_a_block_damaged_before_the_upgrade_stays_data_loss(tmp_path):
    writer = LegacyWriter(tmp_path / "store")
    writer.volume("v", MiB, 4096, DataServices(crc32c=True))
    writer.write("v", 0, os.urandom(8192))
    writer.close()
    path = tmp_path / "store" / "volumes" / "v.vol"
    raw = bytearray(path.read_bytes())
    raw[4096 + 10] ^= 1
    path.write_bytes(raw)
    with FileVolumeStore(tmp_path / "store") as store:
        store.read("v", 0, 4096)
        with pytest.raises(DataCorruption, match="block 1 failed its CRC32C check"):
            store.read("v", 4096, 4096)


def test_an_interrupted_upgrade_starts_over(tmp_path, monkeypatch):
    store_dir = tmp_path / "store"
    expected = old_store(store_dir)
    real = engine_module.CowVolumeStore._import_entries
    calls = []

    def crash_midway(self, node, batch):
        calls.append(node.name)
        if len(calls) == 5:
            raise OSError(5, "simulated crash during the upgrade")
        real(self, node, batch)

    monkeypatch.setattr(engine_module.CowVolumeStore, "_import_entries", crash_midway)
    with pytest.raises(DataCorruption):
        FileVolumeStore(store_dir)
    monkeypatch.undo()
    assert (store_dir / "catalog.sqlite").exists(), (
        "the old format must stay until the copy is done"
    )
    with FileVolumeStore(store_dir) as store:
        for v, (_, _, size, data, _) in expected.items():
            assert store.read(v, 0, size) == data


def test_an_old_store_larger_than_one_checkpoints_worth_of_log_upgrades(tmp_path):
    # The import's commits capture a checkpoint once the log passes checkpoint_log_bytes
    # (1 MiB by default: ~30,000 written blocks), before the journal's thread is started;
    # nothing wrote it, so the import's own checkpoint_now failed ("a checkpoint is
    # pending and nothing writes it") and so did every later open: no upgrade ever.
    store_dir = tmp_path / "store"
    writer = LegacyWriter(store_dir)
    writer.volume("v", 4 * MiB, 512, DataServices(crc32c=True))
    data = os.urandom(4 * MiB)
    writer.db.execute("BEGIN")
    writer.write("v", 0, data)
    writer.db.execute("COMMIT")
    writer.close()
    with FileVolumeStore(store_dir, checkpoint_log_bytes=64 << 10) as store:
        assert store.read("v", 0, 4 * MiB) == data
    assert not (store_dir / "catalog.sqlite").exists()
    with FileVolumeStore(store_dir) as store:
        assert store.read("v", 0, 4 * MiB) == data

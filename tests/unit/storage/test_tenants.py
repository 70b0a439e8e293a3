"""Each volume keeps its owning tenant; catalogs written before tenants still open."""

import sqlite3

from dpu_agent.storage import DataServices, FileVolumeStore

from .conftest import MiB, make_store


def test_the_owner_is_kept_and_listed(store):
    made = store.create("a-vol", MiB, 4096, DataServices(), tenant="tenant-a")
    store.create("plain", MiB, 4096, DataServices())
    assert made.tenant == "tenant-a"
    assert store.get("a-vol").tenant == "tenant-a"
    assert store.get("plain").tenant == "default"
    assert {v.volume_id: v.tenant for v in store.list()} == {
        "a-vol": "tenant-a",
        "plain": "default",
    }
    assert store.resize("a-vol", 2 * MiB).tenant == "tenant-a"


def test_the_owner_survives_a_restart(tmp_path):
    with make_store("file", tmp_path) as store:
        store.create("a-vol", MiB, 4096, DataServices(crc32c=True), tenant="tenant-a")
    with make_store("file", tmp_path) as store:
        assert store.get("a-vol").tenant == "tenant-a"


def test_a_version_1_catalog_is_upgraded_and_its_volumes_are_the_default_tenants(tmp_path):
    with make_store("file", tmp_path) as store:
        store.create("old", MiB, 4096, DataServices(crc32c=True), tenant="tenant-a")
        store.write("old", 0, b"x" * 4096, fua=True)
    catalog = tmp_path / "store" / "catalog.sqlite"
    db = sqlite3.connect(catalog)  # make it what an agent before tenants wrote
    db.execute("ALTER TABLE volumes DROP COLUMN tenant")
    db.execute("PRAGMA user_version=1")
    db.commit()
    db.close()
    with FileVolumeStore(tmp_path / "store") as store:
        info = store.get("old")
        assert info.tenant == "default"
        assert store.read("old", 0, 4096) == b"x" * 4096
        store.create("new", MiB, 4096, DataServices(), tenant="tenant-b")
    db = sqlite3.connect(catalog)
    assert db.execute("PRAGMA user_version").fetchone()[0] == 2
    rows = dict(db.execute("SELECT volume_id, tenant FROM volumes").fetchall())
    db.close()
    assert rows == {"old": "default", "new": "tenant-b"}

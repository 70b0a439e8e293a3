"""Each volume keeps its owning tenant (catalogs written before tenants: test_upgrade.py)."""

from dpu_agent.storage import DataServices

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

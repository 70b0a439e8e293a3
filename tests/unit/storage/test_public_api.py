from dpu_agent import storage
from dpu_agent.errors import AgentError
from dpu_agent.storage.backend import VolumeStore


def test_all_names_exist_and_nothing_public_is_missing():
    for name in storage.__all__:
        assert hasattr(storage, name), name
    modules = {
        "backend",
        "blockmap",
        "checkpoint",
        "dataservices",
        "engine",
        "errors",
        "exports",
        "factory",
        "file_backend",
        "journal",
        "keys",
        "layout",
        "legacy",
        "media",
        "memory_backend",
        "qos",
        "records",
        "space",
        "state",
        "stats",
        "types",
        "validate",
    }
    public = {n for n in dir(storage) if not n.startswith("_")} - modules
    assert public - set(storage.__all__) == set()


def test_backends_implement_the_interface_and_errors_share_the_base():
    assert issubclass(storage.FileVolumeStore, VolumeStore)
    assert issubclass(storage.MemoryVolumeStore, VolumeStore)
    assert issubclass(storage.DataCorruption, AgentError)


def test_interface_names_nothing_file_specific():
    methods = {n for n in vars(VolumeStore) if not n.startswith("_")}
    assert methods == {
        "create",
        "get",
        "list",
        "resize",
        "delete",
        "read",
        "write",
        "write_batch",
        "flush",
        "trim",
        "stats",
        "close",
        "set_qos",
        "throttle",
        "create_snapshot",
        "get_snapshot",
        "list_snapshots",
        "delete_snapshot",
        "clone",
        "max_volume_bytes",
    }

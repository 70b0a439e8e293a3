import host_client


def test_all_names_exist_and_nothing_private_leaks():
    for name in host_client.__all__:
        assert hasattr(host_client, name), name
    # host_client.cli (dpuctl) is a module, set on the package once a test imports it
    public = {n for n in dir(host_client) if not n.startswith("_")} - {"cli"}
    assert public - set(host_client.__all__) == set(), "public names missing from __all__"


def test_errors_share_one_base():
    for name in host_client.__all__:
        obj = getattr(host_client, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, host_client.DpuError)

"""Functions are tenant-owned: another tenant cannot see, change, delete or borrow them."""

import pytest

import host_client
from dpu_wire.v1 import virtualization_pb2
from tests.integration.conftest import start_agent
from tests.integration.pki import make_pki

pytestmark = pytest.mark.asyncio
VF = virtualization_pb2.FUNCTION_TYPE_VF
NVME = virtualization_pb2.FUNCTION_TYPE_NVME


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    agent = start_agent(
        tmp_path_factory.mktemp("agent"),
        pki=pki,
        env={
            "DPU_AGENT_NETWORK_BACKEND": "memory",
            "DPU_AGENT_VIRT_BACKEND": "memory",
            "DPU_AGENT_STORAGE_BACKEND": "memory",
        },
    )
    yield agent, pki
    assert agent.terminate() == 0, agent.log_path.read_text()


def client(setup, name, *, admin=False):
    agent, pki = setup
    return host_client.Client(agent.address, tls=pki.client(name, admin=admin))


async def test_a_tenant_sees_and_touches_only_its_own_functions(setup):
    async with (
        client(setup, "tenant-a") as a,
        client(setup, "tenant-b") as b,
        client(setup, "ops", admin=True) as admin,
    ):
        made = await a.create_function("a-fn", virtualization_pb2.Function(type=VF))
        assert made.tenant == "tenant-a"
        await b.create_function("b-fn", virtualization_pb2.Function(type=VF))
        with pytest.raises(host_client.NotFoundError) as missing:
            await b.get_function("functions/nothing")
        calls = (
            lambda: b.get_function("functions/a-fn"),
            lambda: b.delete_function("functions/a-fn"),
            lambda: b.update_function(
                virtualization_pb2.Function(name="functions/a-fn", mtu=1400), ["mtu"]
            ),
        )
        for call in calls:
            with pytest.raises(host_client.NotFoundError) as theirs:
                await call()
            assert theirs.value.message.replace("a-fn", "X") == missing.value.message.replace(
                "nothing", "X"
            )
        assert [f.name for f in await b.list_functions()] == ["functions/b-fn"]
        assert (await a.get_function("functions/a-fn")).mtu == 1500  # untouched
        everything = {f.name: f.tenant for f in await admin.list_functions()}
        assert everything == {"functions/a-fn": "tenant-a", "functions/b-fn": "tenant-b"}
        # a block function cannot expose another tenant's volume
        await a.create_volume("a-vol", 1 << 20)
        with pytest.raises(host_client.NotFoundError, match="a-vol"):
            await b.create_function(
                "b-disk", virtualization_pb2.Function(type=NVME, volume="volumes/a-vol")
            )
        disk = await a.create_function(
            "a-disk", virtualization_pb2.Function(type=NVME, volume="volumes/a-vol")
        )
        assert disk.volume == "volumes/a-vol"
        await a.delete_function("functions/a-disk")
        await a.delete_function("functions/a-fn")
        await b.delete_function("functions/b-fn")

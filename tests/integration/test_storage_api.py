"""StorageService over real gRPC: volumes and their settings, with clear errors."""

import shutil
import tempfile

import pytest

import host_client
from dpu_wire.v1 import storage_pb2
from tests.integration.conftest import start_agent

pytestmark = pytest.mark.asyncio

MiB = 1 << 20
# More than the disk holds (the store is on the same file system as the temp dir).
TOO_BIG = (shutil.disk_usage(tempfile.gettempdir()).free + (1 << 30)) // 4096 * 4096


def create_request(volume_id, size=8 * MiB, **services):
    return storage_pb2.CreateVolumeRequest(
        volume_id=volume_id,
        volume=storage_pb2.Volume(
            size_bytes=size,
            block_size=4096,
            data_services=storage_pb2.DataServices(**services),
        ),
    )


async def call(client, method, request):
    return await client._call(getattr(client.stubs.storage, method), request)


async def test_create_get_list_resize_delete(agent):
    async with host_client.Client(agent.address) as client:
        created = await call(
            client,
            "CreateVolume",
            create_request(
                "crud-1",
                crc32c=True,
                compression=storage_pb2.COMPRESSION_ZSTD,
                encryption=storage_pb2.ENCRYPTION_AES_XTS_256,
            ),
        )
        assert created.name == "volumes/crud-1"
        assert created.data_services.compression == storage_pb2.COMPRESSION_ZSTD
        assert created.data_services.encryption == storage_pb2.ENCRYPTION_AES_XTS_256
        got = await call(client, "GetVolume", storage_pb2.GetVolumeRequest(name="volumes/crud-1"))
        assert got.size_bytes == 8 * MiB
        assert len(got.stats.latency_bounds_us) == len(got.stats.latency_counts) > 0
        for i in range(2, 6):
            await call(client, "CreateVolume", create_request(f"crud-{i}"))
        page = await call(client, "ListVolumes", storage_pb2.ListVolumesRequest(page_size=3))
        assert [v.name for v in page.volumes] == [
            "volumes/crud-1",
            "volumes/crud-2",
            "volumes/crud-3",
        ]
        rest = await call(
            client,
            "ListVolumes",
            storage_pb2.ListVolumesRequest(page_size=3, page_token=page.next_page_token),
        )
        assert [v.name for v in rest.volumes] == ["volumes/crud-4", "volumes/crud-5"]
        assert rest.next_page_token == ""
        grown = await call(
            client,
            "ResizeVolume",
            storage_pb2.ResizeVolumeRequest(name="volumes/crud-2", size_bytes=16 * MiB),
        )
        assert grown.size_bytes == 16 * MiB
        await call(client, "DeleteVolume", storage_pb2.DeleteVolumeRequest(name="volumes/crud-5"))
        with pytest.raises(host_client.NotFoundError):
            await call(client, "GetVolume", storage_pb2.GetVolumeRequest(name="volumes/crud-5"))


async def test_create_is_idempotent_on_request_id(agent):
    async with host_client.Client(agent.address) as client:
        request = create_request("idem-1")
        request.request_id = "create-idem-1"
        first = await call(client, "CreateVolume", request)
        again = await call(client, "CreateVolume", request)
        assert first.name == again.name == "volumes/idem-1"


async def test_a_retried_delete_gets_the_first_answer(agent):
    """common.proto: a mutating call's retry with the same request_id returns the first
    result. DeleteVolume ignored its request_id and answered the retry NOT_FOUND."""
    async with host_client.Client(agent.address) as client:
        await call(client, "CreateVolume", create_request("idem-del"))
        request = storage_pb2.DeleteVolumeRequest(name="volumes/idem-del", request_id="del-1")
        await call(client, "DeleteVolume", request)
        await call(client, "DeleteVolume", request)  # the first answer again
        request.request_id = "del-2"
        with pytest.raises(host_client.NotFoundError):  # a new request acts, and finds nothing
            await call(client, "DeleteVolume", request)


@pytest.mark.parametrize(
    ("request_msg", "error", "fragment"),
    [
        (create_request("bad-1", size=TOO_BIG), host_client.ResourceExhaustedError, "does not fit"),
        (create_request("bad-5", size=1 << 62), host_client.InvalidArgumentError, "limit"),
        (create_request("bad-2", size=4097), host_client.InvalidArgumentError, "multiple"),
        (create_request("Bad_Id"), host_client.InvalidArgumentError, "volume_id"),
        (create_request("bad-3", size=0), host_client.InvalidArgumentError, "size_bytes"),
        (
            storage_pb2.CreateVolumeRequest(
                volume_id="bad-4",
                volume=storage_pb2.Volume(
                    size_bytes=MiB,
                    data_services=storage_pb2.DataServices(
                        encryption=storage_pb2.ENCRYPTION_AES_XTS_256
                    ),
                ),
                encryption_key=b"k" * 32,
            ),
            host_client.InvalidArgumentError,
            "64 bytes",
        ),
    ],
)
async def test_bad_volumes_are_refused_clearly(agent, request_msg, error, fragment):
    async with host_client.Client(agent.address) as client:
        with pytest.raises(error, match=fragment):
            await call(client, "CreateVolume", request_msg)


async def test_duplicate_and_unknown_volumes(agent):
    async with host_client.Client(agent.address) as client:
        await call(client, "CreateVolume", create_request("dup-1"))
        with pytest.raises(host_client.AlreadyExistsError):
            await call(client, "CreateVolume", create_request("dup-1"))
        with pytest.raises(host_client.NotFoundError):
            await call(
                client,
                "ResizeVolume",
                storage_pb2.ResizeVolumeRequest(name="volumes/nope", size_bytes=MiB),
            )


async def test_volumes_and_settings_survive_an_agent_restart(tmp_path):
    env = {"DPU_AGENT_STORAGE_DIR": str(tmp_path / "volumes")}
    first = start_agent(tmp_path, env=env)
    async with host_client.Client(first.address) as client:
        await call(
            client,
            "CreateVolume",
            create_request("keep-1", crc32c=True, compression=storage_pb2.COMPRESSION_LZ4),
        )
    first.proc.kill()
    first.proc.wait(10)
    second = start_agent(tmp_path, env=env)
    try:
        async with host_client.Client(second.address) as client:
            got = await call(
                client, "GetVolume", storage_pb2.GetVolumeRequest(name="volumes/keep-1")
            )
        assert got.data_services.crc32c
        assert got.data_services.compression == storage_pb2.COMPRESSION_LZ4
    finally:
        assert second.terminate() == 0


async def test_a_second_agent_on_the_same_store_is_refused(tmp_path):
    env = {"DPU_AGENT_STORAGE_DIR": str(tmp_path / "shared")}
    first = start_agent(tmp_path, env=env)
    try:
        with pytest.raises(RuntimeError, match="cannot open the file volume store"):
            start_agent(tmp_path, env=env)
    finally:
        assert first.terminate() == 0

"""The blocking SDK wrapper against a real agent process."""

import pytest

import host_client
from dpu_wire.v1 import agent_pb2


def test_sync_client(agent):
    with host_client.SyncClient(agent.address) as client:
        client.wait_ready(5)
        assert client.health() == "SERVING"
        info = client.agent_info()
    assert isinstance(info, agent_pb2.AgentInfo)
    assert info.name.startswith("agents/")
    with pytest.raises(RuntimeError, match="not open"):
        client.agent_info()


def test_sync_client_maps_errors():
    with (
        host_client.SyncClient("127.0.0.1:1", timeout=5) as client,
        pytest.raises(host_client.UnavailableError),
    ):
        client.agent_info()

"""AgentService: who the agent is and what it can do."""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any

from dpu_agent import __version__, platform
from dpu_wire import API_PACKAGE
from dpu_wire.v1 import agent_pb2, agent_pb2_grpc

if TYPE_CHECKING:
    from collections.abc import Iterable

    import grpc
    from google.protobuf import timestamp_pb2


class AgentInfoService(agent_pb2_grpc.AgentServiceServicer):
    """Serves GetAgentInfo from facts gathered at start-up and the service registry."""

    def __init__(
        self,
        agent_id: str,
        start_time: timestamp_pb2.Timestamp,
        capabilities: Iterable[agent_pb2.Capability],
        devices: Iterable[platform.RdmaDeviceInfo],
        transports: Iterable[int],
    ) -> None:
        uname = os.uname()
        self._info = agent_pb2.AgentInfo(
            name=f"agents/{agent_id}",
            version=__version__,
            api_version=API_PACKAGE,
            hostname=socket.gethostname(),
            machine=uname.machine,
            kernel=uname.release,
            platform=platform.platform_kind(),
            start_time=start_time,
            rdma_devices=[
                agent_pb2.RdmaDevice(
                    name=d.name,
                    node_guid=d.node_guid,
                    ports=[
                        agent_pb2.RdmaPort(
                            port_num=p.port_num,
                            state=p.state,
                            active_mtu=p.active_mtu,
                            link_layer=p.link_layer,
                        )
                        for p in d.ports
                    ],
                )
                for d in devices
            ],
            capabilities=list(capabilities),
            transports=list(transports),  # type: ignore[arg-type]
        )

    async def GetAgentInfo(
        self,
        request: agent_pb2.GetAgentInfoRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> agent_pb2.AgentInfo:
        """Return the agent's identity and capabilities."""
        return self._info

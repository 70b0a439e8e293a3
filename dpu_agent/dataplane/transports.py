"""Which data-plane transports this agent offers, and how to make one per session."""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

from dpu_agent.config import ConfigError
from dpu_agent.dataplane.manager import TRANSPORT_TCP, TRANSPORT_VERBS
from dpu_wire.transport.tcp import TcpAgentTransport

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from dpu_agent.config import AgentConfig
    from dpu_agent.platform import RdmaDeviceInfo
    from dpu_wire.transport.base import AgentTransport

log = logging.getLogger(__name__)


def _active_device(devices: Sequence[RdmaDeviceInfo], wanted: str) -> str | None:
    for device in devices:
        if wanted and device.name != wanted:
            continue
        if any(port.state == "ACTIVE" for port in device.ports):
            return device.name
    return None


def _verbs(device: str, poll_mode: str, queue_depth: int) -> AgentTransport:
    from dpu_wire.transport.verbs import VerbsAgentTransport  # noqa: PLC0415 - needs pyverbs

    return VerbsAgentTransport(device=device, queue_depth=queue_depth, poll_mode=poll_mode)


def _tcp(_queue_depth: int) -> AgentTransport:
    return TcpAgentTransport()


def factories(
    config: AgentConfig, devices: Sequence[RdmaDeviceInfo]
) -> dict[int, Callable[[int], AgentTransport]]:
    """Transport number → factory(queue_depth), per the configuration and the hardware.

    `auto` offers verbs when an RDMA port is ACTIVE, and tcp always. Naming verbs
    explicitly without a usable device is a configuration error.
    """
    wanted = ["verbs", "tcp"] if config.transports == "auto" else config.transports.split(",")
    result: dict[int, Callable[[int], AgentTransport]] = {}
    if "verbs" in wanted:
        device = _active_device(devices, config.rdma_device)
        if device is not None:
            result[TRANSPORT_VERBS] = functools.partial(_verbs, device, config.poll_mode)
        elif config.transports != "auto":
            which = f"RDMA device {config.rdma_device!r} has" if config.rdma_device else "no RDMA"
            which += " no ACTIVE port" if config.rdma_device else " device has an ACTIVE port"
            raise ConfigError(f"dataplane.transports names verbs, but {which}")
        else:
            log.info("no ACTIVE RDMA port: sessions use the tcp transport")
    if "tcp" in wanted:
        result[TRANSPORT_TCP] = _tcp
    return result

"""Which data-plane transports this agent offers, and how each makes a session's link.

A factory takes the host's address from OpenSession, the session's queue depth and
the address of the gRPC peer that asked, and returns a connected `AgentLink`:

- verbs: an RC queue pair on the configured device, moved to RTS towards the host's QP
  (nothing is sent until the host's first capsule arrives);
- tcp: the agent dials the host's listener, but only where the authenticated caller is:
  the host named in the endpoint must resolve to the gRPC peer's own address, or to a
  network `[dataplane] tcp_allow` lists. Then the connection must prove it belongs to
  the session (the host's HELLO carries the token the host sent in OpenSession) before
  the agent sends a byte (`dpu_wire.transport.tcp.dial`). Every failure to connect
  reads the same, so the agent cannot be used to tell closed from filtered ports.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

from dpu_agent.config import ConfigError
from dpu_agent.dataplane.hostpolicy import Allow, parse_allow, resolve_allowed
from dpu_agent.dataplane.manager import TRANSPORT_TCP, TRANSPORT_VERBS
from dpu_wire.transport import tcp
from dpu_wire.transport.base import TcpAddress, TransportError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from dpu_agent.config import AgentConfig
    from dpu_agent.dataplane.manager import LinkFactory
    from dpu_agent.platform import RdmaDeviceInfo
    from dpu_wire.transport.base import AgentLink, PeerAddress

log = logging.getLogger(__name__)


def _active_device(devices: Sequence[RdmaDeviceInfo], wanted: str) -> str | None:
    for device in devices:
        if wanted and device.name != wanted:
            continue
        if any(port.state == "ACTIVE" for port in device.ports):
            return device.name
    return None


async def _verbs(
    device: str, inline_max: int, host: PeerAddress, queue_depth: int, _peer: str
) -> AgentLink:
    from dpu_wire.transport.verbs import VerbsAgentLink  # noqa: PLC0415 - needs pyverbs

    link = VerbsAgentLink(device=device, queue_depth=queue_depth, inline_max=inline_max)
    try:
        link.connect(host)
    except BaseException:
        link.close()
        raise
    return link


async def _tcp(  # noqa: PLR0913, PLR0917 - a LinkFactory (host, queue_depth, peer) after its settings
    allow: Allow,
    op_timeout: float,
    inline_max: int,
    host: PeerAddress,
    queue_depth: int,
    peer: str,
) -> AgentLink:
    if not isinstance(host, TcpAddress):
        raise TransportError("the tcp transport needs a tcp host endpoint")
    address = await resolve_allowed(host.host, host.port, peer, allow)
    sock, token = await tcp.dial(host, address=address)
    return tcp.TcpAgentLink(
        sock,
        token,
        op_timeout=op_timeout,
        inline_max=inline_max,
        queue_depth=queue_depth,
    )


def factories(config: AgentConfig, devices: Sequence[RdmaDeviceInfo]) -> dict[int, LinkFactory]:
    """Transport number → link factory, per the configuration and the hardware.

    `auto` offers verbs when an RDMA port is ACTIVE, and tcp always. Naming verbs
    explicitly without a usable device is a configuration error.
    """
    wanted = ["verbs", "tcp"] if config.transports == "auto" else config.transports.split(",")
    result: dict[int, LinkFactory] = {}
    if "verbs" in wanted:
        device = _active_device(devices, config.rdma_device)
        if device is not None:
            result[TRANSPORT_VERBS] = functools.partial(_verbs, device, config.inline_max)
        elif config.transports != "auto":
            which = f"RDMA device {config.rdma_device!r} has" if config.rdma_device else "no RDMA"
            which += " no ACTIVE port" if config.rdma_device else " device has an ACTIVE port"
            raise ConfigError(f"dataplane.transports names verbs, but {which}")
        else:
            log.info("no ACTIVE RDMA port: sessions use the tcp transport")
    if "tcp" in wanted:
        try:
            allow = parse_allow(config.tcp_allow)
        except ValueError as exc:
            raise ConfigError(f"dataplane.tcp_allow: {exc}") from None
        result[TRANSPORT_TCP] = functools.partial(_tcp, allow, config.op_timeout, config.inline_max)
    return result

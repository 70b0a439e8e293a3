"""Which data-plane transports this agent offers, and how each makes a session's link.

A factory takes the host's address from OpenSession, the session's queue depth and
the address of the gRPC peer that asked, and returns a connected `AgentLink`:

- verbs: an RC queue pair on the configured device, moved to RTS towards the host's QP
  (nothing is sent until the host's first capsule arrives), but only towards a GID
  `[dataplane] verbs_allow` allows (default: any unicast IPv4-mapped GID), and only
  once the host's address has resolved: the kernel resolves a missing neighbour inside
  the modify-QP call, holding up the whole agent, so `neighbour.resolve` does it first,
  off the event loop and the reactor (data-plane.md section 1.2). Every failure to
  reach the host's QP reads the same.
- tcp: the agent dials the host's listener, but only where the authenticated caller is:
  the host named in the endpoint must resolve to the gRPC peer's own address, or to a
  network `[dataplane] tcp_allow` lists. Then the connection must prove it belongs to
  the session (the host's HELLO carries the token the host sent in OpenSession) before
  the agent sends a byte (`dpu_wire.transport.tcp.dial`). Every failure to connect
  reads the same, so the agent cannot be used to tell closed from filtered ports.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
from typing import TYPE_CHECKING, Final

from dpu_agent.config import ConfigError
from dpu_agent.dataplane import neighbour
from dpu_agent.dataplane.hostpolicy import (
    Allow,
    allowed,
    gid_address,
    parse_allow,
    resolve_allowed,
)
from dpu_agent.dataplane.manager import TRANSPORT_TCP, TRANSPORT_VERBS
from dpu_agent.errors import InvalidArgument, PermissionDenied
from dpu_wire.transport import native, tcp
from dpu_wire.transport.base import TcpAddress, TransportError, VerbsAddress

if TYPE_CHECKING:
    from collections.abc import Sequence

    from dpu_agent.config import AgentConfig
    from dpu_agent.dataplane.manager import LinkFactory
    from dpu_agent.platform import RdmaDeviceInfo
    from dpu_wire.transport.base import AgentLink, PeerAddress
    from dpu_wire.transport.verbs import VerbsAgentLink

log = logging.getLogger(__name__)


def _active_device(devices: Sequence[RdmaDeviceInfo], wanted: str) -> str | None:
    for device in devices:
        if wanted and device.name != wanted:
            continue
        if any(port.state == "ACTIVE" for port in device.ports):
            return device.name
    return None


# What OpenSession says for every way the agent's QP fails to reach the host's: an
# address that does not resolve, a modify-QP to RTR or RTS that fails (DP-1.2-6).
QP_CONNECT_FAILED: Final = (
    "the agent's queue pair cannot reach host_endpoint.verbs (its address does not "
    "resolve, or the queue pair cannot be connected to it)"
)


async def _verbs(  # noqa: PLR0913, PLR0917 - a LinkFactory (host, queue_depth, peer) after its settings
    allow: Allow,
    device: str,
    inline_max: int,
    host: PeerAddress,
    queue_depth: int,
    peer: str,
) -> AgentLink:
    if not isinstance(host, VerbsAddress):
        raise TransportError("the verbs transport needs a verbs host endpoint")
    address = gid_address(host.gid)
    if address is None:  # OpenSession checks it first (DP-1.2-3)
        raise InvalidArgument("host_endpoint.verbs.gid must be an IPv4-mapped unicast address")
    if not allowed(address, peer, allow):
        raise PermissionDenied(
            "host_endpoint.verbs.gid is not an address this agent may connect to "
            "([dataplane] verbs_allow)"
        )
    from dpu_wire.transport.verbs import VerbsAgentLink  # noqa: PLC0415 - needs pyverbs

    link = VerbsAgentLink(device=device, queue_depth=queue_depth, inline_max=inline_max)
    try:
        await _reach(link, host, address)
    except BaseException:
        link.close()
        raise
    return link


async def _reach(link: VerbsAgentLink, host: VerbsAddress, address: ipaddress.IPv4Address) -> None:
    """Resolve the host's address off the event loop, then move the link's QP to RTS."""
    source = ipaddress.IPv6Address(link.address.gid).ipv4_mapped
    if source is None:
        raise TransportError(f"the agent's GID {link.address.gid.hex()} is not IPv4-mapped")
    try:
        await neighbour.resolve(address, source, link.netdev_ifindex)
        link.connect(host)  # the neighbour entry is valid: the RDMA core does not wait
    except (neighbour.Unresolved, TransportError) as exc:
        log.info("verbs: cannot connect a queue pair to %s: %s", address, exc)
        raise TransportError(QP_CONNECT_FAILED) from None


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
            try:
                verbs_allow = parse_allow(config.verbs_allow)
            except ValueError as exc:
                raise ConfigError(f"dataplane.verbs_allow: {exc}") from None
            result[TRANSPORT_VERBS] = functools.partial(
                _verbs, verbs_allow, device, config.inline_max
            )
            used, why = native.status()
            log.info(
                "verbs on %s: the native core %s",
                device,
                "posts and polls" if used else f"is not used: {why}",
            )
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

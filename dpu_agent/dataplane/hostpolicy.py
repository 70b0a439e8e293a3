"""Where the agent may open a data-plane connection: the policy behind `tcp_allow`.

The tcp data plane makes the agent dial out, to an address a client names. Unchecked,
that lets a client use the agent to reach (and send to) anything the agent can reach.
So the agent dials only the address the authenticated gRPC call came from, or a
network the operator listed. Pure functions over `ipaddress`, used by the
configuration (to check the setting) and by the tcp link factory.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import urllib.parse
from typing import NamedTuple

from dpu_agent.errors import PermissionDenied

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class Allow(NamedTuple):
    """Whether the gRPC peer's own address is allowed, and which networks besides."""

    peer: bool
    networks: tuple[Network, ...]


def peer_ip(peer: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address in a gRPC peer string ("ipv4:1.2.3.4:5", "ipv6:[::1]:5"), or None."""
    scheme, _, rest = peer.partition(":")
    if scheme not in ("ipv4", "ipv6"):
        return None
    host = urllib.parse.unquote(rest).rpartition(":")[0].strip("[]")
    try:
        address = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def parse_allow(text: str) -> Allow:
    """The policy of a `tcp_allow` setting; ValueError saying what is wrong.

    "peer" (the default): only the caller's own address; "peer,10.0.0.0/8": that or a
    host in the network; a list without "peer": only those networks; "any" (0.0.0.0/0
    and ::/0): anywhere, which gives up this protection.
    """
    peer = False
    networks: list[Network] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        if item == "peer":
            peer = True
        elif item == "any":
            networks += [ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0")]
        else:
            try:
                networks.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                raise ValueError(f"{item!r} is not 'peer', 'any' or a network") from None
    if not peer and not networks:
        raise ValueError("names nothing: use 'peer' (the default)")
    return Allow(peer, tuple(networks))


async def check_host(host: str, peer: str, allow: Allow) -> None:
    """PermissionDenied unless every address `host` names is one the agent may dial."""
    caller = peer_ip(peer)
    allow_peer, networks = allow
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise PermissionDenied(
            f"host_endpoint.tcp.host {host!r} does not resolve to an address the agent may dial"
        ) from None
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if allow_peer and caller is not None and address == caller:
            continue
        if any(address in network for network in networks):
            continue
        raise PermissionDenied(
            "host_endpoint.tcp.host must be the address this call comes from "
            "(or in [dataplane] tcp_allow)"
        )

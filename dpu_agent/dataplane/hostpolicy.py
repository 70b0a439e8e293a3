"""Where the agent may open a data-plane connection: the policy behind `tcp_allow`.

The tcp data plane makes the agent dial out, to an address a client names. Unchecked,
that lets a client use the agent to reach (and send to) anything the agent can reach.
So the agent dials only the address the authenticated gRPC call came from, or a
network the operator listed (data-plane.md DP-1.3-1). The configuration uses
`parse_allow` to check the setting; the tcp link factory asks `resolve_allowed` for
the address to dial.

A host name is resolved once, and the agent dials one of the addresses it checked:
resolving it again to connect would let a name whose DNS answers differently each
time (rebinding) pass the check with an allowed address and be dialled at another.
A lookup runs on a daemon thread of its own, at most `RESOLVERS` at once and for
`RESOLVE_TIMEOUT` seconds at most: a name whose DNS never answers cannot hold up the
threads the agent's other work runs on (asyncio's default executor), and the agent
can exit while a lookup still hangs. A numeric address needs no lookup.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import threading
import urllib.parse
from typing import Any, Final, NamedTuple

from dpu_agent.errors import PermissionDenied, Unavailable

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
AddrInfo = tuple[int, int, int, Any]  # family, type, proto, sockaddr: what to dial

RESOLVE_TIMEOUT: Final = 2.0
RESOLVERS: Final = 4
_resolvers = threading.BoundedSemaphore(RESOLVERS)


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


async def resolve_allowed(host: str, port: int, peer: str, allow: Allow) -> AddrInfo:
    """The address to dial for `host`, resolved once (see the module docstring).

    PermissionDenied unless every address the name gives is one the agent may dial.
    """
    infos = await _addresses(host, port)
    caller = peer_ip(peer)
    allow_peer, networks = allow
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
    family, socktype, proto, _, sockaddr = infos[0]
    return family, socktype, proto, sockaddr


async def _addresses(host: str, port: int) -> list[tuple[Any, ...]]:
    unresolved = PermissionDenied(
        f"host_endpoint.tcp.host {host!r} does not resolve to an address the agent may dial"
    )
    try:  # a numeric address: no lookup, nothing that can block
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except UnicodeError:
        raise unresolved from None
    except OSError:
        pass
    try:
        infos = await _lookup(host, port)
    except (OSError, UnicodeError, TimeoutError):
        raise unresolved from None
    if not infos:
        raise unresolved
    return infos


async def _lookup(host: str, port: int) -> list[tuple[Any, ...]]:
    """Look `host` up on a daemon thread of its own, given up after RESOLVE_TIMEOUT."""
    if not _resolvers.acquire(blocking=False):
        raise Unavailable(
            f"the agent is resolving {RESOLVERS} host names already: "
            "give host_endpoint.tcp.host as an address"
        )
    loop = asyncio.get_running_loop()
    future: asyncio.Future[list[tuple[Any, ...]]] = loop.create_future()

    def settle(result: list[tuple[Any, ...]] | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result or [])

    def run() -> None:
        try:
            result, error = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM), None
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting call
            result, error = None, exc
        finally:
            _resolvers.release()
        with contextlib.suppress(RuntimeError):  # the loop closed: the agent is exiting
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="dpu-resolve", daemon=True).start()
    async with asyncio.timeout(RESOLVE_TIMEOUT):
        return await future

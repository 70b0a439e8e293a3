"""Where the agent may open a data-plane connection: `tcp_allow` and `verbs_allow`.

The tcp data plane makes the agent dial out, to an address a client names. Unchecked,
that lets a client use the agent to reach (and send to) anything the agent can reach.
So the agent dials only the address the authenticated gRPC call came from, or a
network the operator listed (data-plane.md DP-1.3-1). The configuration uses
`parse_allow` to check the setting; the tcp link factory asks `resolve_allowed` for
the address to dial.

The verbs data plane aims the agent's queue pair at the GID a client names. The GID
must be an IPv4-mapped unicast address (`gid_address`, DP-1.2-3: the agent's own GID
is IPv4-mapped RoCEv2), and `verbs_allow`, the same syntax with the default `any`,
says which of those the agent may aim at (`allowed`, DP-1.2-4).

A host name is resolved once, and the agent dials one of the addresses it checked:
resolving it again to connect would let a name whose DNS answers differently each
time (rebinding) pass the check with an allowed address and be dialled at another.
A lookup runs on a daemon thread of its own, at most `RESOLVERS` at once and for
`RESOLVE_TIMEOUT` seconds at most: a name whose DNS never answers cannot hold up the
threads the agent's other work runs on (asyncio's default executor), and the agent
can exit while a lookup still hangs. Of those places a tenant holds at most
`PER_TENANT`, so a tenant naming hosts that never answer cannot keep the others from
theirs. A numeric address needs no lookup. `on_own_thread` and `Slots` are that
mechanism, also used to wait for a verbs host's neighbour entry (neighbour.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import threading
import urllib.parse
from collections import Counter
from typing import TYPE_CHECKING, Any, Final, NamedTuple, TypeVar

from dpu_agent import auth
from dpu_agent.errors import PermissionDenied, Unavailable

if TYPE_CHECKING:
    from collections.abc import Callable

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
AddrInfo = tuple[int, int, int, Any]  # family, type, proto, sockaddr: what to dial

RESOLVE_TIMEOUT: Final = 2.0
RESOLVERS: Final = 8  # host names looked up at once, by all tenants
PER_TENANT: Final = 2  # of those, by one tenant
T = TypeVar("T")
# IPv4 networks whose addresses no RC queue pair can be aimed at: "this network" (the
# unspecified address among it), loopback (RDMA does not run on lo), multicast (an RC
# QP has one peer) and the reserved block with the limited broadcast (data-plane.md
# DP-1.2-3)
NOT_UNICAST: Final = tuple(
    ipaddress.IPv4Network(net) for net in ("0.0.0.0/8", "127.0.0.0/8", "224.0.0.0/4", "240.0.0.0/4")
)


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
    """The policy of a `tcp_allow` or `verbs_allow` setting; ValueError saying what is wrong.

    "peer" (tcp_allow's default): only the caller's own address; "peer,10.0.0.0/8":
    that or a host in the network; a list without "peer": only those networks; "any"
    (0.0.0.0/0 and ::/0; verbs_allow's default): anywhere, which gives up this
    protection.
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
        raise ValueError("names nothing: use 'peer', 'any' or networks")
    return Allow(peer, tuple(networks))


class Slots:
    """At most `total` places taken at once, at most `per_tenant` of them by one tenant.

    The tenant is the caller of the RPC being served ("" outside one). Thread-safe: a
    place is given back by the thread that used it.
    """

    def __init__(self, total: int, per_tenant: int) -> None:
        self.total = total
        self.per_tenant = per_tenant
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()

    @property
    def taken(self) -> int:
        """How many places are held now."""
        with self._lock:
            return self._held.total()

    def take(self, tenant: str) -> str | None:
        """Take a place for `tenant`: None when it got one, else what is all held.

        That is the tenant's `per_tenant` places or all `total`, for the error to name.
        """
        with self._lock:
            if self._held[tenant] >= self.per_tenant:
                return f"{self.per_tenant} of this tenant's"
            if self._held.total() >= self.total:
                return f"{self.total}"
            self._held[tenant] += 1
            return None

    def give(self, tenant: str) -> None:
        """Give back a place `take` gave `tenant`."""
        with self._lock:
            self._held[tenant] -= 1
            if self._held[tenant] <= 0:
                del self._held[tenant]


_resolvers = Slots(RESOLVERS, PER_TENANT)


def allowed(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address, peer: str, allow: Allow
) -> bool:
    """Whether `allow` lets the agent connect to `address` for a call from `peer`."""
    caller = peer_ip(peer)
    if allow.peer and caller is not None and address == caller:
        return True
    return any(address in network for network in allow.networks)


def gid_address(gid: bytes) -> ipaddress.IPv4Address | None:
    """The IPv4 address of a host GID the agent may aim a queue pair at, else None.

    The GID must be IPv4-mapped (::ffff:a.b.c.d), as the agent's own RoCEv2 GID is
    (the RDMA core connects only GIDs of one IP version), and a.b.c.d unicast: not in
    NOT_UNICAST (data-plane.md DP-1.2-3).
    """
    if len(gid) != 16:  # a GID is 16 bytes
        return None
    address = ipaddress.IPv6Address(gid).ipv4_mapped
    if address is None or any(address in network for network in NOT_UNICAST):
        return None
    return address


async def resolve_allowed(host: str, port: int, peer: str, allow: Allow) -> AddrInfo:
    """The address to dial for `host`, resolved once (see the module docstring).

    PermissionDenied unless every address the name gives is one the agent may dial.
    """
    infos = await _addresses(host, port)
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if allowed(address, peer, allow):
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
    return await on_own_thread(
        lambda: socket.getaddrinfo(host, port, type=socket.SOCK_STREAM),
        _resolvers,
        RESOLVE_TIMEOUT,
        lambda held: Unavailable(
            f"the agent is resolving {held} host names already: "
            "give host_endpoint.tcp.host as an address"
        ),
        "dpu-resolve",
    )


async def on_own_thread(
    work: Callable[[], T],
    slots: Slots,
    timeout: float,  # noqa: ASYNC109 - the thread outlives a cancelled wait; it is its bound
    busy: Callable[[str], Exception],
    name: str,
) -> T:
    """`work()` on a new daemon thread, holding a place of `slots` while it runs.

    The place is the caller's tenant's. Raises `busy(what is held)` at once when the
    tenant may not take one, TimeoutError after `timeout` seconds (the thread runs on,
    and gives its place back when `work` returns), or what `work` raised. Nothing of
    asyncio's default executor is used, so work that hangs holds only its own place,
    and the agent can exit while it still runs.
    """
    tenant = auth.caller_tenant()
    held = slots.take(tenant)
    if held is not None:
        raise busy(held)
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(outcome: tuple[T] | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        elif outcome is not None:
            future.set_result(outcome[0])

    def run() -> None:
        outcome: tuple[T] | None = None
        error: BaseException | None = None
        try:
            outcome = (work(),)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting call
            error = exc
        finally:
            slots.give(tenant)
        with contextlib.suppress(RuntimeError):  # the loop closed: the agent is exiting
            loop.call_soon_threadsafe(settle, outcome, error)

    try:
        threading.Thread(target=run, name=name, daemon=True).start()
    except BaseException:
        slots.give(tenant)
        raise
    async with asyncio.timeout(timeout):
        return await future

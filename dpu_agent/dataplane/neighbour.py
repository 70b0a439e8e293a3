"""A verbs host's address, resolved before the agent moves its queue pair to RTR.

On RoCE the kernel's RDMA core needs the MAC address of the host's GID when a queue
pair goes to RTR: it looks up the route from the agent's GID's address to the host's
out of the RDMA port's netdev, then the neighbour entry (ARP) of that route's next
hop. When the entry is missing it asks, and waits inside `ibv_modify_qp` for up to a
second, and pyverbs keeps Python's GIL all that time: every thread of the agent, the
event loop and the reactor included, stood still behind one OpenSession naming an
address nobody answers for (an outside audit: 1.1 s each, serialised).

So `resolve` does that part first, where waiting costs nothing (data-plane.md DP-1.2-5):

- the route and the neighbour entry are looked up with two rtnetlink requests, which
  the kernel answers while it takes them (no wait): a local route (the host on the
  agent's own node) needs no neighbour, and an entry already valid ends it there;
- otherwise one empty UDP datagram from the agent's GID's address (bound to the
  netdev, as the RDMA core routes) to the host's discard port makes the kernel send
  its ARP request, and a daemon thread of its own polls the entry until it is valid,
  `TIMEOUT` seconds at most, `RESOLVERS` such threads at once and `PER_TENANT` of
  them for one tenant (`on_own_thread`, as host names are resolved for tcp).

Only then is the queue pair programmed: the RDMA core finds the entry valid and
`ibv_modify_qp` returns at once. An address that does not resolve raises
`Unresolved`; the link factory answers it as every other failure to connect.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import socket
import struct
import time
from typing import TYPE_CHECKING, Final, NamedTuple, Protocol

from dpu_agent.dataplane.hostpolicy import Slots, on_own_thread
from dpu_agent.errors import Unavailable
from dpu_agent.network import netlink as nl

if TYPE_CHECKING:
    from collections.abc import Callable

log = logging.getLogger(__name__)

TIMEOUT: Final = 2.0  # seconds an ARP answer may take: the first request and one resend
RESOLVERS: Final = 8  # hosts waited for at once; one more is refused at once
PER_TENANT: Final = 4  # of those, for one tenant (a host opens a few sessions at once)
POLL_FIRST: Final = 0.001  # seconds between looks at the entry, doubling up to
POLL_MAX: Final = 0.05
DISCARD_PORT: Final = 9  # what the soliciting datagram is sent to (RFC 863)
NETLINK_TIMEOUT: Final = 1.0  # the kernel answers these requests at once; a bound anyway
RECV_SIZE: Final = 1 << 16
_resolvers = Slots(RESOLVERS, PER_TENANT)

RTM_GETROUTE: Final = 26
RTM_GETNEIGH: Final = 30
RTA_DST: Final = 1
RTA_SRC: Final = 2
RTA_OIF: Final = 4
RTA_GATEWAY: Final = 5
RTN_UNICAST: Final = 1
RTN_LOCAL: Final = 2
NDA_DST: Final = 1
# NUD_REACHABLE | NUD_STALE | NUD_DELAY | NUD_PROBE | NUD_NOARP | NUD_PERMANENT: an entry
# the kernel sends with (include/net/neighbour.h NUD_VALID)
NUD_VALID: Final = 0x02 | 0x04 | 0x08 | 0x10 | 0x40 | 0x80
RTMSG: Final = struct.Struct("=BBBBBBBBI")  # family, dst_len, src_len, tos, table, protocol,
# scope, type, flags
NDMSG: Final = struct.Struct("=BBHiHBB")  # family, pad1, pad2, ifindex, state, flags, type
SO_BINDTODEVICE: Final[int] = getattr(socket, "SO_BINDTODEVICE", 25)


class Unresolved(Exception):
    """The host's address does not resolve: no usable route, or no ARP answer."""


class Hop(NamedTuple):
    """The neighbour a route sends through: its address and netdev."""

    address: ipaddress.IPv4Address
    ifindex: int


class Kernel(Protocol):
    """What resolution asks of the kernel (`Rtnetlink`; a fake in the unit tests)."""

    def next_hop(
        self, dst: ipaddress.IPv4Address, src: ipaddress.IPv4Address, oif: int
    ) -> Hop | None:
        """The neighbour packets to `dst` go through; None for a local route.

        Unresolved when there is no route, or one that is not unicast out of `oif`.
        """

    def valid(self, hop: Hop) -> bool:
        """Whether the kernel holds a valid (usable) neighbour entry for `hop`."""

    def solicit(self, dst: ipaddress.IPv4Address, src: ipaddress.IPv4Address, oif: int) -> None:
        """Make the kernel resolve the next hop to `dst` (send it something)."""

    def close(self) -> None:
        """Let go of the kernel sockets."""


class Rtnetlink:
    """`Kernel` over one NETLINK_ROUTE socket (route and neighbour get requests)."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, nl.NETLINK_ROUTE)
        try:
            self._sock.settimeout(NETLINK_TIMEOUT)
            self._sock.bind((0, 0))
        except OSError:
            self._sock.close()
            raise
        self._seq = 0

    def close(self) -> None:
        """Close the socket."""
        self._sock.close()

    def _request(self, msg_type: int, body: bytes) -> bytes:
        """The kernel's one answer to a get request (nl.KernelError if it refused)."""
        self._seq += 1
        self._sock.send(nl.message(msg_type, nl.NLM_F_REQUEST, self._seq, body))
        while True:
            for kind, _flags, seq, msg in nl.messages(self._sock.recv(RECV_SIZE)):
                if seq != self._seq:
                    continue
                if kind in (nl.NLMSG_ERROR, nl.NLMSG_DONE):
                    raise nl.KernelError(nl.error_code(msg) or errno.EPROTO, "")
                return msg

    def next_hop(
        self, dst: ipaddress.IPv4Address, src: ipaddress.IPv4Address, oif: int
    ) -> Hop | None:
        """The next hop to `dst` from `src` out of `oif`, as the RDMA core will route."""
        body = RTMSG.pack(socket.AF_INET, 32, 32, 0, 0, 0, 0, 0, 0)
        body += nl.attr(RTA_DST, dst.packed) + nl.attr(RTA_SRC, src.packed)
        if oif:
            body += nl.u32(RTA_OIF, oif)
        try:
            answer = self._request(RTM_GETROUTE, body)
        except nl.KernelError as exc:  # ENETUNREACH, EHOSTUNREACH, EINVAL, ...
            raise Unresolved(f"no route to {dst}: {exc}") from None
        kind = answer[nl.NLMSGHDR.size + 7]
        attrs = nl.parse_attrs(answer, nl.NLMSGHDR.size + RTMSG.size)
        return route_hop(dst, oif, kind, attrs)

    def valid(self, hop: Hop) -> bool:
        """Whether `hop` has a neighbour entry in a NUD_VALID state."""
        body = NDMSG.pack(socket.AF_INET, 0, 0, hop.ifindex, 0, 0, 0)
        body += nl.attr(NDA_DST, hop.address.packed)
        try:
            answer = self._request(RTM_GETNEIGH, body)
        except nl.KernelError as exc:
            if exc.code == errno.ENOENT:  # no entry (yet)
                return False
            raise
        state: int = NDMSG.unpack_from(answer, nl.NLMSGHDR.size)[4]
        return bool(state & NUD_VALID)

    def solicit(self, dst: ipaddress.IPv4Address, src: ipaddress.IPv4Address, oif: int) -> None:
        """See the module's `solicit`."""
        solicit(dst, src, oif)


def route_hop(
    dst: ipaddress.IPv4Address, oif: int, kind: int, attrs: dict[int, bytes]
) -> Hop | None:
    """The next hop of a route the kernel answered (type `kind`, attributes `attrs`)."""
    if kind == RTN_LOCAL:
        return None  # the RDMA core loops it back: no neighbour
    if kind != RTN_UNICAST:  # broadcast, multicast, blackhole, unreachable, prohibit
        raise Unresolved(f"the route to {dst} is of type {kind}, not unicast")
    out = struct.unpack("=I", attrs[RTA_OIF])[0] if RTA_OIF in attrs else 0
    if oif and out != oif:
        raise Unresolved(f"the route to {dst} leaves by netdev {out}, not the RDMA port's {oif}")
    gateway = attrs.get(RTA_GATEWAY)
    return Hop(ipaddress.IPv4Address(gateway) if gateway else dst, out)


def solicit(dst: ipaddress.IPv4Address, src: ipaddress.IPv4Address, oif: int) -> None:
    """Send an empty UDP datagram to `dst`'s discard port from `src`, out of `oif`.

    Sending is what makes the kernel resolve the neighbour (an ARP request, the
    datagram queued until the answer). The socket is bound to the RDMA port's netdev
    where the agent may (SO_BINDTODEVICE; as the RDMA core's route lookup is) and to
    the agent's GID's address, so the route it takes is the one the QP will.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        if oif:
            with contextlib.suppress(OSError):  # unprivileged before Linux 5.7
                sock.setsockopt(
                    socket.SOL_SOCKET, SO_BINDTODEVICE, socket.if_indextoname(oif).encode()
                )
        try:
            sock.bind((str(src), 0))
            sock.connect((str(dst), DISCARD_PORT))
        except OSError as exc:
            raise Unresolved(f"no route to {dst} from {src}: {exc}") from None
        with contextlib.suppress(OSError):  # queued behind the ARP request, or refused
            sock.send(b"")


def wait_valid(
    kernel: Kernel,
    hop: Hop,
    timeout: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Poll `hop`'s neighbour entry until it is valid; Unresolved after `timeout` s."""
    deadline = clock() + timeout
    pause = POLL_FIRST
    while not kernel.valid(hop):
        left = deadline - clock()
        if left <= 0:
            raise Unresolved(f"{hop.address} did not answer ARP within {timeout:g} s")
        sleep(min(pause, left))
        pause = min(2 * pause, POLL_MAX)


async def resolve(
    dst: ipaddress.IPv4Address,
    src: ipaddress.IPv4Address,
    oif: int,
    *,
    kernel: Callable[[], Kernel] | None = None,
) -> None:
    """Make sure the kernel holds a valid neighbour entry for the route to `dst`.

    From the agent's GID's address `src` out of the RDMA port's netdev `oif` (0: any).
    Unresolved when the address does not resolve within TIMEOUT; Unavailable when
    RESOLVERS hosts are being waited for already. `kernel` makes a `Kernel` (default:
    an `Rtnetlink`).
    """
    kernel = kernel or Rtnetlink
    try:
        quick = kernel()
    except OSError as exc:
        raise Unresolved(f"rtnetlink: {exc}") from None
    try:  # on the event loop: the kernel answers these two requests at once
        hop = quick.next_hop(dst, src, oif)
        if hop is None or quick.valid(hop):
            return
    except (OSError, nl.KernelError) as exc:
        raise Unresolved(f"rtnetlink: {exc}") from None
    finally:
        quick.close()

    def wait() -> None:
        slow = kernel()
        try:
            slow.solicit(dst, src, oif)
            wait_valid(slow, hop, TIMEOUT)
        finally:
            slow.close()

    def busy(held: str) -> Unavailable:
        return Unavailable(
            f"the agent is resolving the addresses of {held} verbs hosts already: try again"
        )

    try:
        await on_own_thread(wait, _resolvers, TIMEOUT + 1.0, busy, "dpu-neighbour")
    except (TimeoutError, OSError, nl.KernelError) as exc:
        raise Unresolved(f"{dst}: {exc or type(exc).__name__}") from None

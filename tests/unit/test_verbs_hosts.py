"""Where the agent aims a verbs queue pair (data-plane.md 1.2, DP-1.2-3..6).

The host's GID must be an IPv4-mapped unicast address, `verbs_allow` decides which of
those, and the host's address is resolved off the event loop before the queue pair is
programmed: an outside audit saw one OpenSession naming an address nobody answers ARP
for stop the whole agent for a second inside `ibv_modify_qp` (RTR), four in a row for
4.6 s, and a multicast GID accepted.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import socket
import threading

import pytest

from dpu_agent import auth, config
from dpu_agent.dataplane import hostpolicy, neighbour, transports
from dpu_agent.dataplane.hostpolicy import allowed, gid_address, parse_allow
from dpu_agent.dataplane.neighbour import Hop, Unresolved
from dpu_agent.errors import InvalidArgument, PermissionDenied, Unavailable
from dpu_agent.platform import RdmaDeviceInfo, RdmaPortInfo
from dpu_agent.services.convert import peer_address
from dpu_wire.transport.base import TransportError, VerbsAddress
from dpu_wire.v1 import session_pb2

PEER = "ipv4:127.0.0.1:40000"
AGENT_IP = ipaddress.IPv4Address("192.168.77.1")
HOST_IP = ipaddress.IPv4Address("192.168.77.2")
NETDEV = 7  # the RDMA port's netdev


def mapped(ip: str) -> bytes:
    return ipaddress.IPv6Address(f"::ffff:{ip}").packed


def gid(text: str) -> bytes:
    return ipaddress.IPv6Address(text).packed


# ------------------------------------------------------------------ the GID, DP-1.2-3


@pytest.mark.parametrize(
    "raw",
    [
        gid("::"),
        gid("::1"),
        gid("ff02::1"),  # the audit's multicast GID, which was accepted
        gid("ff0e::1234"),
        gid("fe80::1"),  # link-local: a MAC from the GID only for a RoCEv1 source GID
        gid("2001:db8::1"),  # IPv6: the agent's own GID is IPv4-mapped
        gid("::ffff:0:0"),  # ::ffff:0.0.0.0
        mapped("0.255.255.255"),
        mapped("127.0.0.1"),
        mapped("127.255.0.9"),
        mapped("224.0.0.1"),
        mapped("239.255.255.250"),
        mapped("240.0.0.1"),
        mapped("255.255.255.255"),
        gid("::a00:1"),  # IPv4-compatible (deprecated), not IPv4-mapped
        bytes(15),
    ],
    ids=lambda raw: str(ipaddress.IPv6Address(raw)) if len(raw) == 16 else f"{len(raw)} bytes",
)
def test_a_gid_no_queue_pair_can_be_aimed_at_is_refused(raw):
    assert gid_address(raw) is None
    endpoint = session_pb2.Endpoint(
        verbs=session_pb2.VerbsEndpoint(gid=raw, qp_num=17, psn=5, mtu=1024)
    )
    with pytest.raises(InvalidArgument, match=r"host_endpoint\.verbs\.gid"):
        peer_address(endpoint)


@pytest.mark.parametrize("ip", ["10.0.0.1", "192.168.77.2", "169.254.1.1", "1.0.0.0", "223.1.2.3"])
def test_an_ipv4_mapped_unicast_gid_is_fine(ip):
    assert gid_address(mapped(ip)) == ipaddress.IPv4Address(ip)
    endpoint = session_pb2.Endpoint(
        verbs=session_pb2.VerbsEndpoint(gid=mapped(ip), qp_num=17, psn=5, mtu=1024)
    )
    assert isinstance(peer_address(endpoint), VerbsAddress)


# ------------------------------------------------------------------ the policy, DP-1.2-4


def test_verbs_allow_reads_as_tcp_allow_does():
    host = ipaddress.IPv4Address("10.1.2.3")
    assert allowed(host, PEER, parse_allow("any"))
    assert not allowed(host, PEER, parse_allow("peer"))
    assert allowed(host, "ipv4:10.1.2.3:5000", parse_allow("peer"))
    assert allowed(host, "ipv6:[::ffff:10.1.2.3]:5000", parse_allow("peer"))
    assert allowed(host, PEER, parse_allow("peer, 10.1.0.0/16"))
    assert not allowed(host, PEER, parse_allow("10.2.0.0/16,192.168.0.0/16"))
    with pytest.raises(ValueError, match="names nothing"):
        parse_allow(" , ")


def test_verbs_allow_is_a_setting_whose_default_is_any():
    assert config.load(None, environ={}).verbs_allow == "any"
    loaded = config.load(None, environ={"DPU_AGENT_VERBS_ALLOW": " peer , 10.0.0.0/8 "})
    assert loaded.verbs_allow == "peer,10.0.0.0/8"
    with pytest.raises(config.ConfigError, match=r"VERBS_ALLOW: 'everywhere' is not"):
        config.load(None, environ={"DPU_AGENT_VERBS_ALLOW": "everywhere"})


def test_verbs_allow_goes_to_the_verbs_factory():
    devices = [RdmaDeviceInfo("rxe0", "0", (RdmaPortInfo(1, "ACTIVE", 4096, "Ethernet"),))]
    cfg = config.load(None, environ={"DPU_AGENT_VERBS_ALLOW": "peer,10.0.0.0/8"})
    factory = transports.factories(cfg, devices)[1]
    assert factory.args[0] == parse_allow("peer,10.0.0.0/8")  # type: ignore[attr-defined]


# ------------------------------------------------------------------ the factory


class FakeLink:
    """A VerbsAgentLink that records what was done to it."""

    made: list[FakeLink] = []  # noqa: RUF012 - the test's record
    connect_error: TransportError | None = None

    def __init__(self, **_kwargs: object) -> None:
        self.connected: list[VerbsAddress] = []
        self.closed = False
        self.address = VerbsAddress(mapped(str(AGENT_IP)), 0x11, 5, 4096)
        self.netdev_ifindex = NETDEV
        FakeLink.made.append(self)

    def connect(self, host: VerbsAddress) -> None:
        if FakeLink.connect_error is not None:
            raise FakeLink.connect_error
        self.connected.append(host)

    def close(self) -> None:
        self.closed = True


class FakeKernel:
    """Routes and a neighbour table, as `neighbour.Kernel`; `valid_after`: when ARP answers."""

    routes: dict[ipaddress.IPv4Address, Hop | Unresolved | None] = {}  # noqa: RUF012
    valid_after: dict[ipaddress.IPv4Address, int] = {}  # noqa: RUF012 - looks until valid
    looks: dict[ipaddress.IPv4Address, int] = {}  # noqa: RUF012
    solicited: list[tuple[ipaddress.IPv4Address, ipaddress.IPv4Address, int]] = []  # noqa: RUF012
    threads: set[str] = set()  # noqa: RUF012 - where valid() was called from

    def next_hop(self, dst, _src, oif):
        route = self.routes.get(dst, Hop(dst, oif))
        if isinstance(route, Unresolved):
            raise route
        return route

    def valid(self, hop):
        FakeKernel.threads.add(threading.current_thread().name)
        looks = FakeKernel.looks[hop.address] = FakeKernel.looks.get(hop.address, 0) + 1
        wanted = self.valid_after.get(hop.address)
        return wanted is not None and looks > wanted

    def solicit(self, dst, src, oif):
        FakeKernel.solicited.append((dst, src, oif))

    def close(self):
        pass


@pytest.fixture
def fakes(monkeypatch):
    from dpu_wire.transport import verbs  # noqa: PLC0415 - imports without pyverbs

    FakeLink.made = []
    FakeLink.connect_error = None
    FakeKernel.routes = {}
    FakeKernel.valid_after = {}
    FakeKernel.looks = {}
    FakeKernel.solicited = []
    FakeKernel.threads = set()
    monkeypatch.setattr(verbs, "VerbsAgentLink", FakeLink)
    monkeypatch.setattr(neighbour, "Rtnetlink", FakeKernel)
    monkeypatch.setattr(neighbour, "TIMEOUT", 0.3)


async def open_verbs(ip: ipaddress.IPv4Address, allow: str = "any", peer: str = PEER):
    host = VerbsAddress(mapped(str(ip)), 0x22, 9, 4096)
    return await transports._verbs(parse_allow(allow), "rxe0", 0, host, 8, peer)


@pytest.mark.asyncio
@pytest.mark.usefixtures("fakes")
async def test_a_gid_verbs_allow_leaves_out_is_refused_before_a_queue_pair_is_made():
    with pytest.raises(PermissionDenied, match="verbs_allow"):
        await open_verbs(HOST_IP, "peer,10.0.0.0/8")
    assert FakeLink.made == []
    FakeKernel.valid_after[HOST_IP] = 0
    link = await open_verbs(HOST_IP, "peer", peer=f"ipv4:{HOST_IP}:5000")
    assert link.connected


@pytest.mark.asyncio
@pytest.mark.usefixtures("fakes")
async def test_a_host_whose_address_is_resolved_already_is_connected_at_once():
    FakeKernel.valid_after[HOST_IP] = 0
    link = await open_verbs(HOST_IP)
    assert link.connected == [VerbsAddress(mapped(str(HOST_IP)), 0x22, 9, 4096)]
    assert FakeKernel.solicited == []  # nothing sent, no thread
    assert FakeKernel.threads == {threading.current_thread().name}


@pytest.mark.asyncio
@pytest.mark.usefixtures("fakes")
async def test_the_agent_asks_for_the_hosts_address_off_the_loop_then_connects():
    FakeKernel.valid_after[HOST_IP] = 3  # the ARP answer comes after a few looks
    link = await open_verbs(HOST_IP)
    assert link.connected
    assert FakeKernel.solicited == [(HOST_IP, AGENT_IP, NETDEV)]
    assert "dpu-neighbour" in FakeKernel.threads  # the waiting was on a thread of its own


@pytest.mark.asyncio
@pytest.mark.usefixtures("fakes")
async def test_a_gateways_address_is_what_is_resolved():
    gateway = ipaddress.IPv4Address("192.168.77.254")
    far = ipaddress.IPv4Address("10.9.9.9")
    FakeKernel.routes[far] = Hop(gateway, NETDEV)
    FakeKernel.valid_after[gateway] = 1
    link = await open_verbs(far)
    assert link.connected
    assert list(FakeKernel.looks) == [gateway]


@pytest.mark.asyncio
@pytest.mark.usefixtures("fakes")
async def test_a_host_on_the_agents_own_node_needs_no_neighbour():
    FakeKernel.routes[AGENT_IP] = None  # a local route
    link = await open_verbs(AGENT_IP)
    assert link.connected
    assert FakeKernel.looks == {}


@pytest.mark.asyncio
@pytest.mark.usefixtures("fakes")
async def test_an_address_that_does_not_resolve_is_refused_without_programming_the_qp():
    """No ARP answer within the timeout: UNAVAILABLE (a TransportError), the queue pair
    never connected and closed, and the event loop free all the while."""
    ticks = 0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0.005)

    counting = asyncio.create_task(ticker())
    try:
        with pytest.raises(TransportError) as unresolved:
            await open_verbs(ipaddress.IPv4Address("192.168.77.99"))
    finally:
        stop.set()
        await counting
    (link,) = FakeLink.made
    assert link.connected == []
    assert link.closed
    assert str(unresolved.value) == transports.QP_CONNECT_FAILED
    assert ticks >= 10  # the loop went on while the agent waited for ARP (0.3 s)


@pytest.mark.asyncio
@pytest.mark.usefixtures("fakes")
async def test_every_way_to_miss_the_host_reads_the_same():
    """DP-1.2-6: no route, no ARP answer, a modify-QP that fails."""
    FakeKernel.routes[ipaddress.IPv4Address("192.0.2.1")] = Unresolved("no route")
    errors = []
    for ip in ("192.0.2.1", "192.168.77.99"):
        with pytest.raises(TransportError) as info:
            await open_verbs(ipaddress.IPv4Address(ip))
        errors.append(str(info.value))
    FakeKernel.valid_after[HOST_IP] = 0
    FakeLink.connect_error = TransportError("Failed to modify QP state to RTR. Errno: 22")
    with pytest.raises(TransportError) as info:
        await open_verbs(HOST_IP)
    errors.append(str(info.value))
    assert set(errors) == {transports.QP_CONNECT_FAILED}
    assert all(link.closed for link in FakeLink.made)


@pytest.mark.asyncio
@pytest.mark.usefixtures("fakes")
async def test_waits_for_arp_are_bounded():
    """At most RESOLVERS hosts are waited for, PER_TENANT of them for one tenant; one
    more is refused at once, saying so, while a host whose address is known still
    connects."""
    total, per_tenant = neighbour.RESOLVERS, neighbour.PER_TENANT

    async def as_tenant(tenant: str, ip: ipaddress.IPv4Address) -> object:
        auth.principal.set(auth.Principal(tenant))
        return await open_verbs(ip)

    silent = [ipaddress.IPv4Address(f"192.168.77.{100 + i}") for i in range(total)]
    waits = [
        asyncio.ensure_future(as_tenant(f"t{i // per_tenant}", ip)) for i, ip in enumerate(silent)
    ]
    while neighbour._resolvers.taken < total:  # noqa: ASYNC110 - threads take the slots
        await asyncio.sleep(0.001)
    with pytest.raises(Unavailable, match=f"resolving the addresses of {total} verbs hosts"):
        await as_tenant("z", ipaddress.IPv4Address("192.168.77.200"))
    with pytest.raises(Unavailable, match=f"addresses of {per_tenant} of this tenant's verbs"):
        await as_tenant("t0", ipaddress.IPv4Address("192.168.77.201"))
    FakeKernel.valid_after[HOST_IP] = 0
    assert (await open_verbs(HOST_IP)).connected
    results = await asyncio.gather(*waits, return_exceptions=True)
    assert all(isinstance(r, TransportError) for r in results), results
    while neighbour._resolvers.taken:  # noqa: ASYNC110
        await asyncio.sleep(0.01)


# ------------------------------------------------------------------ neighbour.py pieces


def test_the_route_decides_what_is_resolved():
    dst = ipaddress.IPv4Address("10.0.0.5")
    oif = {neighbour.RTA_OIF: NETDEV.to_bytes(4, "little")}
    gateway = {**oif, neighbour.RTA_GATEWAY: bytes([10, 0, 0, 1])}
    assert neighbour.route_hop(dst, NETDEV, neighbour.RTN_UNICAST, oif) == Hop(dst, NETDEV)
    assert neighbour.route_hop(dst, NETDEV, neighbour.RTN_UNICAST, gateway) == Hop(
        ipaddress.IPv4Address("10.0.0.1"), NETDEV
    )
    assert neighbour.route_hop(dst, NETDEV, neighbour.RTN_LOCAL, {}) is None
    with pytest.raises(Unresolved, match="type 3"):  # RTN_BROADCAST: 10.0.0.255 on a /24
        neighbour.route_hop(dst, NETDEV, 3, oif)
    with pytest.raises(Unresolved, match="not the RDMA port's"):
        neighbour.route_hop(dst, NETDEV + 1, neighbour.RTN_UNICAST, oif)


def test_waiting_gives_up_at_the_timeout():
    now = [0.0]
    slept = []

    class Never:
        def valid(self, _hop):
            return False

    def sleep(seconds):
        slept.append(seconds)
        now[0] += seconds

    with pytest.raises(Unresolved, match="did not answer ARP within 2 s"):
        neighbour.wait_valid(Never(), Hop(HOST_IP, 1), 2.0, clock=lambda: now[0], sleep=sleep)  # type: ignore[arg-type]
    assert now[0] == pytest.approx(2.0)
    assert max(slept) <= neighbour.POLL_MAX


def test_the_kernel_is_asked_over_rtnetlink():
    """The real requests: the loopback route is local (no neighbour), a neighbour nobody
    asked for has no entry."""
    kernel = neighbour.Rtnetlink()
    try:
        loopback = ipaddress.IPv4Address("127.0.0.1")
        assert kernel.next_hop(loopback, loopback, 0) is None
        lo = socket.if_nametoindex("lo")
        try:
            valid = kernel.valid(Hop(ipaddress.IPv4Address("127.0.0.9"), lo))
        except OSError as exc:
            if exc.errno != errno.EOPNOTSUPP:
                raise
            # qemu-user (the arm64 unit run) does not translate RTM_GETNEIGH; the arm64
            # guest and the x86 VM run real kernels, where every verbs session asks it
            pytest.skip("this emulator does not pass RTM_GETNEIGH to the kernel")
        assert not valid
    finally:
        kernel.close()


def test_hostpolicy_runs_name_lookups_and_arp_waits_on_separate_bounded_threads():
    assert hostpolicy._resolvers is not neighbour._resolvers

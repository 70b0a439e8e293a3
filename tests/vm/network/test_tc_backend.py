"""TcFlowBackend against the kernel: real packets between namespaces, only flow rules between.

See conftest.py for the topology (h1, h2, h3 behind rep1, rep2, rep3 in netns dpu).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import ipaddress
import os
import socket
import struct
import threading
import time

import pytest

from dpu_agent.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from dpu_agent.network.model import (
    Count,
    Drop,
    FlowMatch,
    FlowRule,
    Forward,
    InstalledRule,
    Mirror,
    OffloadPolicy,
    Police,
    PortKind,
    VlanPush,
    VxlanDecap,
    VxlanEncap,
)
from dpu_agent.network.tc_backend import TcFlowBackend, rule_cookie
from tests.vm.network.topology import HOSTS, filters_text, ns_socket, ping, sh

pytestmark = pytest.mark.tc

IPV4 = 0x0800
UDP = 17
SOL_PACKET = 263
PACKET_AUXDATA = 8
PACKET_OUTGOING = 4
TP_STATUS_VLAN_VALID = 1 << 4
ETH_P_ALL = 0x0003


def forward(rule_id: str, priority: int, src: str, dst: str, match: FlowMatch | None = None):
    return FlowRule(rule_id, priority, src, match or FlowMatch(), (Forward(dst),))


def udp_match(port: int) -> FlowMatch:
    return FlowMatch(ethertype=IPV4, ip_protocol=UDP, dst_port=port)


def udp_receiver(host: str, port: int) -> socket.socket:
    sock = ns_socket(host, socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((HOSTS[host], port))
    return sock


def udp_send(src: str, dst: str, port: int, payloads: list[bytes]) -> None:
    with ns_socket(src, socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for payload in payloads:
            sock.sendto(payload, (HOSTS[dst], port))


def received(sock: socket.socket, wait: float = 0.5) -> list[bytes]:
    """Datagrams that arrive until `wait` seconds pass without one."""
    sock.settimeout(wait)
    got = []
    while True:
        try:
            got.append(sock.recv(65536))
        except TimeoutError:
            return got


def capture(host: str) -> socket.socket:
    """An AF_PACKET socket on the host's eth0 that reports VLAN tags (PACKET_AUXDATA)."""
    sock = ns_socket(host, socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(SOL_PACKET, PACKET_AUXDATA, 1)
    sock.bind(("eth0", ETH_P_ALL))
    return sock


def frames_with(sock: socket.socket, magic: bytes, want: int, wait: float = 3.0):
    """(frame, VLAN TCI or None) of received frames that contain `magic`."""
    found: list[tuple[bytes, int | None]] = []
    deadline = time.monotonic() + wait
    sock.settimeout(0.1)
    while len(found) < want and time.monotonic() < deadline:
        try:
            data, ancillary, _, address = sock.recvmsg(65536, socket.CMSG_SPACE(20))
        except TimeoutError:
            continue
        if magic not in data or address[2] == PACKET_OUTGOING:
            continue
        tci = None
        for level, kind, blob in ancillary:
            if (level, kind) == (SOL_PACKET, PACKET_AUXDATA):
                status, _, _, _, _, vlan_tci, _ = struct.unpack_from("=IIIHHHH", blob)
                if status & TP_STATUS_VLAN_VALID:
                    tci = vlan_tci
        if tci is None and data[12:14] == b"\x81\x00":  # the tag still in the frame
            tci = struct.unpack_from("!H", data, 14)[0]
        found.append((data, tci))
    return found


def tcp_transfer(src: str, dst: str, port: int, data: bytes) -> bytes:
    """Send `data` over one TCP connection from src to dst; what dst received."""
    got = bytearray()
    with ns_socket(dst, socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((HOSTS[dst], port))
        server.listen(1)
        server.settimeout(20)

        def serve() -> None:
            conn, _ = server.accept()
            with conn:
                conn.settimeout(20)
                while chunk := conn.recv(65536):
                    got.extend(chunk)

        thread = threading.Thread(target=serve)
        thread.start()
        with ns_socket(src, socket.AF_INET, socket.SOCK_STREAM) as client:
            client.settimeout(20)
            client.connect((HOSTS[dst], port))
            client.sendall(data)
            client.shutdown(socket.SHUT_WR)
            thread.join(30)
    return bytes(got)


def tx_bytes(backend: TcFlowBackend, port: str) -> int:
    return next(p.counters.tx_bytes for p in backend.ports() if p.name == port)


def test_ports_are_the_managed_netdevs(backend):
    ports = backend.ports()
    assert [p.name for p in ports] == ["rep1", "rep2", "rep3"]
    for port in ports:
        assert port.kind is PortKind.REPRESENTOR
        assert port.up
        assert port.mtu == 1500
        assert len(port.mac.split(":")) == 6


def test_forward_rules_carry_ping_and_tcp(backend):
    assert ping("h1", HOSTS["h2"], count=1, timeout=1.0) == 0  # no bridge: no path yet
    to_h2 = forward("fwd-1-2", 100, "rep1", "rep2")
    to_h1 = forward("fwd-2-1", 100, "rep2", "rep1")
    start_ns = time.time_ns()
    backend.install(to_h2)
    backend.install(to_h1)

    assert ping("h1", HOSTS["h2"], count=3) == 3
    data = os.urandom(256 << 10)
    assert tcp_transfer("h1", "h2", 5001, data) == data

    there, back = backend.counters(to_h2), backend.counters(to_h1)
    assert there.packets >= 3 + 2  # echo requests, SYN, data segments, FIN
    assert back.packets >= 3 + 2  # echo replies, SYN-ACK, ACKs
    assert there.bytes > len(data)
    assert start_ns - 50_000_000 <= there.last_used_ns <= time.time_ns() + 50_000_000
    assert not there.in_hardware


def test_drop_rule_above_forward_drops_only_its_udp(backend):
    backend.install(forward("fwd-1-2", 100, "rep1", "rep2"))
    backend.install(forward("fwd-2-1", 100, "rep2", "rep1"))
    drop = FlowRule("drop-9999", 10, "rep1", udp_match(9999), (Drop(),))
    backend.install(drop)

    with udp_receiver("h2", 9999) as dropped, udp_receiver("h2", 9998) as passed:
        udp_send("h1", "h2", 9999, [b"lost %d" % i for i in range(20)])
        udp_send("h1", "h2", 9998, [b"kept %d" % i for i in range(5)])
        assert len(received(passed)) == 5
        assert received(dropped, wait=0.2) == []
    assert ping("h1", HOSTS["h2"], count=2) == 2
    assert backend.counters(drop).packets == 20


def test_police_caps_a_udp_flood_near_its_rate(backend):
    rate_bps = 8_000_000
    policed = FlowRule(
        "police-5001", 10, "rep1", udp_match(5001), (Police(rate_bps, 64 << 10), Forward("rep2"))
    )
    backend.install(policed)
    payload = b"\xa5" * 1000
    frame_bytes = 14 + 20 + 8 + len(payload)
    with (
        udp_receiver("h2", 5001),
        ns_socket("h1", socket.AF_INET, socket.SOCK_DGRAM) as sender,
    ):
        before = tx_bytes(backend, "rep2")
        sent, start = 0, time.monotonic()
        while (elapsed := time.monotonic() - start) < 2.0:
            try:
                sender.sendto(payload, (HOSTS["h2"], 5001))
                sent += 1
            except OSError:  # ENOBUFS: the flood outran the stack, try again
                continue
        time.sleep(0.2)
        delivered_bps = (tx_bytes(backend, "rep2") - before) * 8 / elapsed
    offered_bps = sent * frame_bytes * 8 / elapsed
    assert offered_bps > 2 * rate_bps, f"the sender offered only {offered_bps / 1e6:.1f} Mbit/s"
    # The kernel's policer does the work; this checks it is configured as asked.
    assert 0.5 * rate_bps <= delivered_bps <= 1.5 * rate_bps, (
        f"delivered {delivered_bps / 1e6:.2f} Mbit/s of {offered_bps / 1e6:.1f} offered,"
        f" policed at {rate_bps / 1e6:.0f}"
    )
    assert backend.counters(policed).packets >= sent * 0.9


def test_vlan_push_tags_what_h2_receives(backend):
    backend.install(
        FlowRule("vlan-7000", 10, "rep1", udp_match(7000), (VlanPush(100, 3), Forward("rep2")))
    )
    magic = b"vlan-push-" + os.urandom(8).hex().encode()
    with capture("h2") as sniffer:
        udp_send("h1", "h2", 7000, [magic] * 5)
        frames = frames_with(sniffer, magic, want=5)
    assert len(frames) == 5
    for _, tci in frames:
        assert tci is not None, "h2 got the frame without an 802.1Q tag"
        assert (tci & 0x0FFF, tci >> 13) == (100, 3)


def test_mirror_copies_to_rep3_while_h2_still_gets_it(backend):
    mirrored = FlowRule(
        "mirror-7001", 10, "rep1", udp_match(7001), (Mirror("rep3"), Forward("rep2"))
    )
    backend.install(mirrored)
    magic = b"mirror-" + os.urandom(8).hex().encode()
    with capture("h3") as sniffer, udp_receiver("h2", 7001) as receiver:
        udp_send("h1", "h2", 7001, [magic] * 5)
        assert received(receiver) == [magic] * 5
        copies = frames_with(sniffer, magic, want=5)
    assert len(copies) == 5
    assert all(tci is None for _, tci in copies)
    assert backend.counters(mirrored).packets == 5


BAD_RULES = [
    (FlowMatch(ip_protocol=UDP), (Drop(),), InvalidArgument, "ip_protocol needs"),
    (FlowMatch(ethertype=0x0806, ip_protocol=UDP), (Drop(),), InvalidArgument, "ip_protocol"),
    (FlowMatch(ethertype=IPV4, dst_port=80), (Drop(),), InvalidArgument, "L4 port needs"),
    (
        FlowMatch(ethertype=0x86DD, dst_ip=ipaddress.ip_network("10.10.0.0/24")),
        (Drop(),),
        InvalidArgument,
        "IP version",
    ),
    (FlowMatch(), (Drop(), Forward("rep2")), InvalidArgument, "both forward and drop"),
    (FlowMatch(), (Drop(), Count()), InvalidArgument, "last action"),
    (FlowMatch(), (), InvalidArgument, "at least one action"),
    (FlowMatch(), (Forward("rep9"),), NotFound, "rep9"),
    (FlowMatch(src_mac="02:00:00:00:00"), (Count(),), InvalidArgument, "MAC"),
]


def test_bad_rules_raise_and_leave_the_datapath_unchanged(backend):
    backend.install(forward("fwd-1-2", 100, "rep1", "rep2"))
    before, ours = filters_text(), backend.installed()
    for number, (match, actions, error, words) in enumerate(BAD_RULES):
        with pytest.raises(error, match=words):
            backend.install(FlowRule(f"bad-{number}", 50, "rep1", match, actions))
    with pytest.raises(NotFound, match="not a managed port"):
        backend.install(FlowRule("bad-port", 50, "eth0", FlowMatch(), (Drop(),)))
    with pytest.raises(InvalidArgument, match="priority"):
        backend.install(FlowRule("bad-prio", 0, "rep1", FlowMatch(), (Drop(),)))
    with pytest.raises(AlreadyExists, match="priority 100"):
        backend.install(forward("same-prio", 100, "rep1", "rep3"))
    # The kernel refuses skip_sw on a veth (no offload): its reason, and nothing left.
    for port in ("rep1", "rep3"):  # rep3 has no clsact yet: one is created, and stays
        hardware = FlowRule("hw", 60, port, FlowMatch(), (Drop(),), OffloadPolicy.HARDWARE_ONLY)
        with pytest.raises(FailedPrecondition, match=r"kernel refused .*not supported"):
            backend.install(hardware)
    assert filters_text() == before
    assert backend.installed() == ours
    assert "clsact" in sh("tc", "-n", "dpu", "qdisc", "show", "dev", "rep3").stdout


def test_installed_tells_ours_from_others(backend):
    rule = FlowRule("ours-1", 5, "rep3", udp_match(53), (Count(),))
    backend.install(rule)
    tc = ("tc", "-n", "dpu", "filter", "add", "dev", "rep3", "ingress", "protocol", "ip")
    sh(*tc, "pref", "7", "flower", "action", "drop")
    sh(*tc, "pref", "8", "flower", "action", "drop", "cookie", "0badc0de")
    assert backend.installed() == [
        InstalledRule("rep3", 5, "ours-1"),
        InstalledRule("rep3", 7, None),
        InstalledRule("rep3", 8, None),
    ]
    with pytest.raises(AlreadyExists):
        backend.install(FlowRule("ours-2", 7, "rep3", FlowMatch(), (Count(),)))

    # A restarted agent: the cookie tells the filter is ours, not which rule it is.
    with TcFlowBackend(("rep*",), netns="dpu") as restarted:
        marker = "cookie:" + rule_cookie("ours-1").hex()
        assert InstalledRule("rep3", 5, marker) in restarted.installed()
        restarted.remember([rule])
        assert InstalledRule("rep3", 5, "ours-1") in restarted.installed()
        assert restarted.counters(rule).packets == 0
        restarted.remove(rule)
        restarted.remove(rule)  # gone: no error
        # Someone else's filter at the rule's priority is not the rule: left alone.
        restarted.remove(FlowRule("ours-1", 7, "rep3", FlowMatch(), (Count(),)))
    assert backend.installed() == [InstalledRule("rep3", 7, None), InstalledRule("rep3", 8, None)]
    with pytest.raises(NotFound, match="not installed"):
        backend.counters(rule)


def test_concurrent_installs_and_removes(backend):
    rules = [
        FlowRule(f"many-{n}", n, "rep3", udp_match(10000 + n), (Drop(),)) for n in range(1, 33)
    ]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(backend.install, rules))
        assert backend.installed() == [InstalledRule("rep3", r.priority, r.rule_id) for r in rules]
        list(pool.map(backend.remove, rules))
    assert backend.installed() == []


@pytest.mark.usefixtures("backend")  # removes the filters afterwards
def test_offload_policy_sets_the_skip_flags():
    sw = FlowRule("sw", 30, "rep2", FlowMatch(), (Count(),))
    with TcFlowBackend(("rep*",), "dpu", OffloadPolicy.SOFTWARE_ONLY) as software:
        software.install(sw)
        shown = sh("tc", "-n", "dpu", "filter", "show", "dev", "rep2", "ingress").stdout
        assert "skip_hw" in shown
        assert "not_in_hw" in shown
        assert not software.counters(sw).in_hardware
        with pytest.raises(FailedPrecondition):
            software.install(
                dataclasses.replace(sw, priority=31, offload=OffloadPolicy.HARDWARE_ONLY)
            )


@pytest.mark.usefixtures("backend")
def test_vxlan_encap_and_decap_rules():
    sh("ip", "-n", "dpu", "link", "add", "vx0", "type", "vxlan", "dstport", "4789", "external")
    try:
        sh("ip", "-n", "dpu", "link", "set", "vx0", "up")
        with TcFlowBackend(("rep*", "vx*"), netns="dpu") as flow:
            tunnel = VxlanEncap(
                42, ipaddress.ip_address("10.10.0.1"), ipaddress.ip_address("10.10.0.2")
            )
            encap = FlowRule("encap", 20, "rep1", udp_match(4000), (tunnel, Forward("vx0")))
            decap = FlowRule(
                "decap", 20, "vx0", FlowMatch(vxlan_vni=42), (VxlanDecap(), Forward("rep2"))
            )
            flow.install(encap)
            flow.install(decap)
            shown = sh("tc", "-n", "dpu", "filter", "show", "dev", "rep1", "ingress").stdout
            for words in (
                "tunnel_key",
                "src_ip 10.10.0.1",
                "key_id 42",
                "dst_port 4789",
                "device vx0",
            ):
                assert words in shown
            shown = sh("tc", "-n", "dpu", "filter", "show", "dev", "vx0", "ingress").stdout
            for words in ("enc_key_id 42", "unset", "device rep2"):
                assert words in shown
            assert {"encap", "decap"} <= {r.rule_id for r in flow.installed()}
            with pytest.raises(InvalidArgument, match="followed by a forward"):
                flow.install(FlowRule("no-fwd", 21, "rep1", FlowMatch(), (tunnel,)))
            flow.remove(encap)
            flow.remove(decap)
    finally:
        sh("ip", "-n", "dpu", "link", "del", "vx0", check=False)

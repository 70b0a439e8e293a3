"""Hosts in network namespaces, joined only by flow rules; helpers to send and capture.

Topology (built once per test module, removed afterwards)::

    netns dpu: rep1        rep2        rep3       <- the managed ports (TcFlowBackend)
                 |           |           |          veth pairs, no bridge
    netns h1:  eth0      h2: eth0    h3: eth0
             10.10.0.1     10.10.0.2   10.10.0.3 /24, static neighbours, no IPv6

Only private test addresses, only in namespaces made here. Sockets of the hosts are
made in-process (`ns_socket`), and the VM has no ping binary: `ping` is ICMP over a
raw socket.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import threading
import time
from dataclasses import dataclass

from pyroute2.netns import setns

DPU = "dpu"
HOSTS = {"h1": "10.10.0.1", "h2": "10.10.0.2", "h3": "10.10.0.3"}
REPS = {"h1": "rep1", "h2": "rep2", "h3": "rep3"}
HOW_TO_RUN = "run it in the test VM: python3 deploy/testvm/testvm.py run -- ..."


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command; on failure (with check) raise with its stderr."""
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
    return done


def ns_socket(netns: str, family: int, kind: int, proto: int = 0) -> socket.socket:
    """A socket that lives in `netns` (made by a thread that setns()-es there)."""
    made: list[socket.socket | BaseException] = []

    def enter() -> None:
        try:
            setns(netns, flags=0)
            made.append(socket.socket(family, kind, proto))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            made.append(exc)

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total: int = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def ping(src: str, dst: str, count: int = 3, timeout: float = 2.0) -> int:
    """ICMP echo replies `src` (a namespace) gets from `dst` (the VM has no ping binary)."""
    ident = os.getpid() & 0xFFFF
    replies = 0
    with ns_socket(src, socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as sock:
        sock.settimeout(0.2)
        for seq in range(count):
            header = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
            payload = b"dpu-agent tc test"
            packet = struct.pack("!BBHHH", 8, 0, _checksum(header + payload), ident, seq)
            sock.sendto(packet + payload, (dst, 0))
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    data, (peer, _) = sock.recvfrom(2048)
                except TimeoutError:
                    continue
                ihl = (data[0] & 0x0F) * 4
                kind, _, _, rid, rseq = struct.unpack_from("!BBHHH", data, ihl)
                if peer == dst and kind == 0 and (rid, rseq) == (ident, seq):
                    replies += 1
                    break
    return replies


def flower_unusable() -> str | None:
    """None if clsact + a flower filter work here, else why not."""
    probe = f"dputc-probe-{os.getpid()}"
    try:
        sh("ip", "netns", "add", probe)
    except (RuntimeError, OSError) as exc:
        return f"cannot create a network namespace: {exc}"
    try:
        sh("ip", "-n", probe, "link", "add", "name", "pa", "type", "veth", "peer", "name", "pb")
        sh("tc", "-n", probe, "qdisc", "add", "dev", "pa", "clsact")
        sh(
            *("tc", "-n", probe, "filter", "add", "dev", "pa", "ingress", "pref", "1"),
            *("protocol", "ip", "flower", "ip_proto", "udp", "action", "drop"),
        )
    except RuntimeError as exc:
        why = " ".join(str(exc).split())
        return f"tc flower is not usable here ({why}); {HOW_TO_RUN}"
    finally:
        sh("ip", "netns", "del", probe, check=False)
    return None


@dataclass(frozen=True)
class Topology:
    """The namespaces made for a module, and the hosts' MAC addresses."""

    dpu: str
    macs: dict[str, str]

    @staticmethod
    def ip(host: str) -> str:
        return HOSTS[host]

    @staticmethod
    def rep(host: str) -> str:
        return REPS[host]


def build() -> dict[str, str]:
    for ns in (DPU, *HOSTS):
        sh("ip", "netns", "add", ns)
        sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
        sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    macs = {}
    for host, address in HOSTS.items():
        rep = REPS[host]
        sh(
            "ip",
            "-n",
            DPU,
            "link",
            "add",
            rep,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            host,
        )
        sh("ip", "-n", host, "addr", "add", f"{address}/24", "dev", "eth0")
        sh("ip", "-n", host, "link", "set", "eth0", "up")
        sh("ip", "-n", DPU, "link", "set", rep, "up")
        link = json.loads(sh("ip", "-n", host, "-j", "link", "show", "eth0").stdout)
        macs[host] = link[0]["address"]
    for host in HOSTS:  # no ARP needed (the VLAN test's h2 could not answer it)
        for peer, address in HOSTS.items():
            if peer != host:
                sh(
                    *("ip", "-n", host, "neigh", "replace", address, "lladdr", macs[peer]),
                    *("dev", "eth0", "nud", "permanent"),
                )
    return macs


def teardown() -> None:
    for ns in (DPU, *HOSTS):
        sh("ip", "netns", "del", ns, check=False)


def flush_filters() -> None:
    """Delete every filter on the ingress of rep1..rep3 (qdiscs stay)."""
    for rep in REPS.values():
        sh("tc", "-n", DPU, "filter", "del", "dev", rep, "ingress", check=False)


def filters_text() -> str:
    """`tc filter show` of every rep's ingress (no statistics: stable text)."""
    return "".join(
        sh("tc", "-n", DPU, "filter", "show", "dev", rep, "ingress", check=False).stdout
        for rep in REPS.values()
    )

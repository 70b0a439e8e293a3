"""Flow rules and ports as the agent understands them, independent of any datapath."""

from __future__ import annotations

import dataclasses
import enum
import fnmatch
import ipaddress

from dpu_agent.auth import DEFAULT_TENANT

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class PortKind(enum.StrEnum):
    """What a port is."""

    UPLINK = "uplink"  # physical port (p0, p1)
    REPRESENTOR = "representor"  # a host function's representor (pf0vf0, pf0sf1, ...)
    HOST = "host"  # any other netdev the agent manages


class OffloadPolicy(enum.StrEnum):
    """Where a rule may run."""

    ANY = "any"  # hardware if possible, else software (tc: no skip flag)
    HARDWARE_ONLY = "hardware"  # tc skip_sw
    SOFTWARE_ONLY = "software"  # tc skip_hw


@dataclasses.dataclass(frozen=True)
class PortCounters:
    """64-bit interface counters."""

    rx_packets: int = 0
    tx_packets: int = 0
    rx_bytes: int = 0
    tx_bytes: int = 0
    rx_dropped: int = 0
    tx_dropped: int = 0


@dataclasses.dataclass(frozen=True)
class PortInfo:
    """A port the agent manages."""

    name: str
    kind: PortKind
    up: bool
    mac: str
    mtu: int
    counters: PortCounters = PortCounters()


@dataclasses.dataclass(frozen=True)
class FlowMatch:
    """Match fields; None matches anything."""

    ethertype: int | None = None
    src_mac: str | None = None
    dst_mac: str | None = None
    vlan_id: int | None = None
    ip_protocol: int | None = None
    src_ip: IPNetwork | None = None
    dst_ip: IPNetwork | None = None
    src_port: int | None = None
    dst_port: int | None = None
    vxlan_vni: int | None = None


@dataclasses.dataclass(frozen=True)
class Forward:
    """Redirect to another port's egress."""

    port: str


@dataclasses.dataclass(frozen=True)
class Drop:
    """Drop the packet."""


@dataclasses.dataclass(frozen=True)
class Mirror:
    """Send a copy to another port's egress, and go on."""

    port: str


@dataclasses.dataclass(frozen=True)
class Police:
    """Drop what exceeds `rate_bps` bits per second with a `burst_bytes` bucket."""

    rate_bps: int
    burst_bytes: int


@dataclasses.dataclass(frozen=True)
class VlanPush:
    """Add an 802.1Q tag."""

    vlan_id: int
    priority: int = 0


@dataclasses.dataclass(frozen=True)
class VlanPop:
    """Remove the outer 802.1Q tag."""


@dataclasses.dataclass(frozen=True)
class VxlanEncap:
    """Set tunnel metadata (the packet must then be forwarded to a vxlan port)."""

    vni: int
    src_ip: IPAddress
    dst_ip: IPAddress
    dst_port: int = 4789


@dataclasses.dataclass(frozen=True)
class VxlanDecap:
    """Release tunnel metadata of a packet received on a vxlan port."""


@dataclasses.dataclass(frozen=True)
class Count:
    """Count only (every rule counts; this makes a rule that does nothing else valid)."""


Action = Forward | Drop | Mirror | Police | VlanPush | VlanPop | VxlanEncap | VxlanDecap | Count


@dataclasses.dataclass(frozen=True)
class FlowRule:
    """A rule on one port's ingress: if `match`, apply `actions` in order.

    `priority` orders rules on a port (lower first, 1..65535 as tc's pref). The
    datapath identifies the rule by (ingress_port, priority): two rules on one port
    never share a priority. `tenant` owns the rule (see `dpu_agent.auth`).
    """

    rule_id: str
    priority: int
    ingress_port: str
    match: FlowMatch
    actions: tuple[Action, ...]
    offload: OffloadPolicy = OffloadPolicy.ANY
    tenant: str = DEFAULT_TENANT


@dataclasses.dataclass(frozen=True)
class RuleCounters:
    """What the datapath counted for a rule."""

    packets: int = 0
    bytes: int = 0
    last_used_ns: int = 0  # wall clock; 0 = never
    in_hardware: bool = False


@dataclasses.dataclass(frozen=True)
class InstalledRule:
    """A filter found in the datapath; `rule_id` is None when the agent did not make it."""

    ingress_port: str
    priority: int
    rule_id: str | None


UPLINK_PATTERNS = ("p[0-9]*",)
REPRESENTOR_PATTERNS = ("pf*vf*", "pf*sf*", "pf*hpf", "rep*")


def port_kind(name: str) -> PortKind:
    """What a netdev is, from its name (BlueField naming).

    `p0`, `p1` (`p[0-9]*`) are UPLINKs; `pf0vf3`, `pf1sf2`, `pf0hpf` and `rep*` are
    REPRESENTORs; anything else is HOST.
    """
    if any(fnmatch.fnmatchcase(name, p) for p in UPLINK_PATTERNS):
        return PortKind.UPLINK
    if any(fnmatch.fnmatchcase(name, p) for p in REPRESENTOR_PATTERNS):
        return PortKind.REPRESENTOR
    return PortKind.HOST

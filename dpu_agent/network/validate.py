"""Checks of a flow rule before any datapath sees it: contradictions get a reason."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Final

from dpu_agent.errors import InvalidArgument
from dpu_agent.network.model import (
    Action,
    Drop,
    FlowMatch,
    FlowRule,
    Forward,
    Mirror,
    Police,
    VlanPush,
    VxlanEncap,
)

if TYPE_CHECKING:
    from collections.abc import Collection

ETH_IPV4: Final = 0x0800
ETH_IPV6: Final = 0x86DD
ETH_VLAN: Final = 0x8100
L4_PROTOCOLS: Final = {6: "tcp", 17: "udp", 132: "sctp"}
MAC: Final = re.compile(r"[0-9a-f]{2}(:[0-9a-f]{2}){5}")
MAX_ACTIONS: Final = 16


def _check_range(value: int | None, low: int, high: int, what: str) -> None:
    if value is not None and not low <= value <= high:
        raise InvalidArgument(f"{what} must be {low}..{high}, not {value}")


def check_rule(rule: FlowRule, ports: Collection[str]) -> None:
    """Raise InvalidArgument with the reason if the rule is malformed or contradictory."""
    _check_range(rule.priority, 1, 65535, "priority")
    if rule.ingress_port not in ports:
        raise InvalidArgument(f"ingress port {rule.ingress_port!r} is not a managed port")
    _check_match(rule.match)
    _check_actions(rule, ports)


def _check_match(m: FlowMatch) -> None:
    _check_range(m.ethertype, 0, 0xFFFF, "match.ethertype")
    _check_range(m.vlan_id, 0, 4095, "match.vlan_id")
    _check_range(m.ip_protocol, 0, 255, "match.ip_protocol")
    _check_range(m.src_port, 0, 65535, "match.src_l4_port")
    _check_range(m.dst_port, 0, 65535, "match.dst_l4_port")
    _check_range(m.vxlan_vni, 0, (1 << 24) - 1, "match.vxlan_vni")
    for what, mac in (("src_mac", m.src_mac), ("dst_mac", m.dst_mac)):
        if mac is not None and not MAC.fullmatch(mac):
            raise InvalidArgument(f"match.{what} {mac!r} is not a MAC address (aa:bb:cc:dd:ee:ff)")
    families = {net.version for net in (m.src_ip, m.dst_ip) if net is not None}
    if len(families) > 1:
        raise InvalidArgument("match: source and destination prefixes are different IP versions")
    if families and m.ethertype is not None and m.ethertype not in (ETH_IPV4, ETH_IPV6, ETH_VLAN):
        raise InvalidArgument("match: an IP prefix needs an IPv4 or IPv6 ethertype")
    if families and m.ethertype is not None:
        wanted = ETH_IPV4 if 4 in families else ETH_IPV6
        if m.ethertype not in (wanted, ETH_VLAN):
            raise InvalidArgument("match: the IP prefixes do not fit the ethertype")
    if m.ip_protocol is not None and not families and m.ethertype not in (ETH_IPV4, ETH_IPV6):
        raise InvalidArgument("match.ip_protocol needs an IP ethertype (0x0800 or 0x86dd)")
    if (m.src_port is not None or m.dst_port is not None) and m.ip_protocol not in L4_PROTOCOLS:
        raise InvalidArgument("match: an L4 port needs ip_protocol tcp (6), udp (17) or sctp (132)")


def _check_actions(rule: FlowRule, ports: Collection[str]) -> None:
    if not rule.actions:
        raise InvalidArgument("a rule needs at least one action")
    if len(rule.actions) > MAX_ACTIONS:
        raise InvalidArgument(f"a rule takes at most {MAX_ACTIONS} actions")
    forwards = [a for a in rule.actions if isinstance(a, Forward)]
    if len(forwards) > 1:
        raise InvalidArgument("a rule forwards to at most one port")
    if forwards and any(isinstance(a, Drop) for a in rule.actions):
        raise InvalidArgument("a rule cannot both forward and drop")
    if any(isinstance(a, Drop) for a in rule.actions[:-1]):
        raise InvalidArgument("drop must be the last action")
    for index, action in enumerate(rule.actions):
        _check_action(rule, index, action, ports)


def _check_action(rule: FlowRule, index: int, action: Action, ports: Collection[str]) -> None:
    where = f"actions[{index}]"
    if isinstance(action, Forward | Mirror):
        if action.port not in ports:
            raise InvalidArgument(f"{where}: port {action.port!r} is not a managed port")
        if action.port == rule.ingress_port:
            raise InvalidArgument(f"{where}: a rule cannot send to its own ingress port")
    elif isinstance(action, Police):
        if action.rate_bps <= 0 or action.burst_bytes <= 0:
            raise InvalidArgument(f"{where}: police needs a rate and a burst above 0")
    elif isinstance(action, VlanPush):
        _check_range(action.vlan_id, 1, 4094, f"{where}: vlan_push.vlan_id")
        _check_range(action.priority, 0, 7, f"{where}: vlan_push.priority")
    elif isinstance(action, VxlanEncap):
        _check_range(action.vni, 0, (1 << 24) - 1, f"{where}: vxlan_encap.vni")
        if action.src_ip.version != action.dst_ip.version:
            raise InvalidArgument(f"{where}: vxlan_encap addresses are different versions")
        if not any(isinstance(a, Forward) for a in rule.actions[index + 1 :]):
            raise InvalidArgument(f"{where}: vxlan_encap must be followed by a forward")

"""The one check of a flow rule: the service and every datapath use it, the limits are here.

`check_rule(rule, ports)` raises InvalidArgument with the reason when a rule is
malformed, contradictory, or wider than asked for on tc flower (which silently
ignores `ip_protocol` without an IP ethertype and L4 ports without TCP/UDP/SCTP).
`ports`, when given, is the set of managed port names the rule's ports must be in
(the service passes them; a datapath checks its ports itself and passes None).

The limits, stated once (`LIMITS`; both ends included):
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Final

from dpu_agent.errors import InvalidArgument
from dpu_agent.network.model import (
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

    from dpu_agent.network.model import Action

ETH_IPV4: Final = 0x0800
ETH_IPV6: Final = 0x86DD
ETH_VLAN: Final = 0x8100
ETH_QINQ: Final = 0x88A8
IP_ETHERTYPES: Final = {4: ETH_IPV4, 6: ETH_IPV6}
L4_PROTOCOLS: Final = {6: "tcp", 17: "udp", 132: "sctp"}
MAC: Final = re.compile(r"[0-9a-fA-F]{2}(:[0-9a-fA-F]{2}){5}")

#: what -> (lowest, highest). Error messages name the `what`.
LIMITS: Final[dict[str, tuple[int, int]]] = {
    "priority": (1, 0xFFFF),  # tc's pref; 0 would let the kernel choose
    "match.ethertype": (0, 0xFFFF),
    "match.vlan_id": (0, 4094),  # 4095 is reserved (802.1Q)
    "match.ip_protocol": (0, 255),
    "match.src_port": (0, 0xFFFF),
    "match.dst_port": (0, 0xFFFF),
    "match.vxlan_vni": (0, (1 << 24) - 1),
    "actions": (1, 32),  # TCA_ACT_MAX_PRIO: the kernel's actions per filter
    "vlan_push.vlan_id": (1, 4094),
    "vlan_push.priority": (0, 7),
    "vxlan_encap.vni": (0, (1 << 24) - 1),
    "vxlan_encap.dst_port": (1, 0xFFFF),
    "police.rate_bps": (8, (1 << 64) - 1),  # tc counts bytes per second: at least 1
    "police.burst_bytes": (1, (1 << 32) - 1),
}
MAX_ACTIONS: Final = LIMITS["actions"][1]

__doc__ = (
    (__doc__ or "")
    + "\n"
    + "\n".join(f"- {what}: {low}..{high}" for what, (low, high) in LIMITS.items())
)


_MATCH_RANGES: Final = tuple(
    (field, f"match.{field}")
    for field in ("ethertype", "vlan_id", "ip_protocol", "src_port", "dst_port", "vxlan_vni")
)


def check_range(value: int | None, what: str, where: str = "") -> None:
    """InvalidArgument unless `value` (None: absent) is within `LIMITS[what]`."""
    low, high = LIMITS[what]
    if value is not None and not low <= value <= high:
        raise InvalidArgument(f"{where}{what} must be {low}..{high}, not {value}")


def check_rule(rule: FlowRule, ports: Collection[str] | None = None) -> None:
    """Raise InvalidArgument with the reason if the rule is malformed or contradictory."""
    check_range(rule.priority, "priority")
    if ports is not None and rule.ingress_port not in ports:
        raise InvalidArgument(f"ingress port {rule.ingress_port!r} is not a managed port")
    check_match(rule.match)
    _check_actions(rule, ports)


def l3_ethertype(m: FlowMatch) -> int | None:
    """The ethertype a valid match selects below any VLAN tag (given, or implied by its IPs)."""
    if m.ethertype is not None:
        return m.ethertype
    src, dst = m.src_ip, m.dst_ip
    if src is None or dst is None:
        net = src if dst is None else dst
        return None if net is None else IP_ETHERTYPES[net.version]
    return IP_ETHERTYPES[src.version] if src.version == dst.version else None


def check_match(m: FlowMatch) -> None:
    """InvalidArgument unless flower can match exactly what `m` asks for."""
    for field, what in _MATCH_RANGES:
        value = getattr(m, field)
        if value is not None:
            check_range(value, what)
    for what, mac in (("src_mac", m.src_mac), ("dst_mac", m.dst_mac)):
        if mac is not None and not MAC.fullmatch(mac):
            raise InvalidArgument(f"match.{what} {mac!r} is not a MAC address (aa:bb:cc:dd:ee:ff)")
    if m.vlan_id is not None and m.ethertype in (ETH_VLAN, ETH_QINQ):
        raise InvalidArgument("match: with vlan_id, ethertype is the type inside the tag (no QinQ)")
    versions = {net.version for net in (m.src_ip, m.dst_ip) if net is not None}
    if len(versions) > 1:
        raise InvalidArgument("match: source and destination prefixes are different IP versions")
    if versions and m.ethertype is not None and m.ethertype != IP_ETHERTYPES[versions.pop()]:
        raise InvalidArgument(
            f"match: ethertype {m.ethertype:#06x} does not carry the IP version of the prefixes"
        )
    ethertype = l3_ethertype(m)
    if m.ip_protocol is not None and ethertype not in (ETH_IPV4, ETH_IPV6):
        raise InvalidArgument(
            "match: ip_protocol needs an IP ethertype (0x0800 or 0x86dd, or an IP prefix"
            " to imply it); flower would ignore it and match every protocol"
        )
    if (m.src_port is not None or m.dst_port is not None) and m.ip_protocol not in L4_PROTOCOLS:
        raise InvalidArgument("match: an L4 port needs ip_protocol tcp (6), udp (17) or sctp (132)")


def _check_actions(rule: FlowRule, ports: Collection[str] | None) -> None:
    low, high = LIMITS["actions"]
    if len(rule.actions) < low:
        raise InvalidArgument("a rule needs at least one action (count to only count)")
    if len(rule.actions) > high:
        raise InvalidArgument(f"a rule takes at most {high} actions, not {len(rule.actions)}")
    forwards = [a for a in rule.actions if isinstance(a, Forward)]
    if len(forwards) > 1:
        raise InvalidArgument("a rule forwards to at most one port")
    if forwards and any(isinstance(a, Drop) for a in rule.actions):
        raise InvalidArgument("a rule cannot both forward and drop")
    for index, action in enumerate(rule.actions):
        _check_action(rule, index, action, ports)


def _check_action(
    rule: FlowRule, index: int, action: Action, ports: Collection[str] | None
) -> None:
    where = f"actions[{index}]: "
    if isinstance(action, (Forward, Drop)) and index != len(rule.actions) - 1:
        raise InvalidArgument(f"{where}{type(action).__name__.lower()} must be the last action")
    if isinstance(action, (Forward, Mirror)):
        if ports is not None and action.port not in ports:
            raise InvalidArgument(f"{where}port {action.port!r} is not a managed port")
        if action.port == rule.ingress_port:
            raise InvalidArgument(f"{where}a rule cannot send to its own ingress port")
    elif isinstance(action, Police):
        check_range(action.rate_bps, "police.rate_bps", where)
        check_range(action.burst_bytes, "police.burst_bytes", where)
    elif isinstance(action, VlanPush):
        check_range(action.vlan_id, "vlan_push.vlan_id", where)
        check_range(action.priority, "vlan_push.priority", where)
    elif isinstance(action, VxlanEncap):
        check_range(action.vni, "vxlan_encap.vni", where)
        check_range(action.dst_port, "vxlan_encap.dst_port", where)
        if action.src_ip.version != action.dst_ip.version:
            raise InvalidArgument(f"{where}vxlan_encap addresses are different IP versions")
        if not any(isinstance(a, Forward) for a in rule.actions[index + 1 :]):
            raise InvalidArgument(f"{where}vxlan_encap must be followed by a forward")

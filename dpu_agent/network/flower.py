"""Flow rules as tc flower filters, and filters read back: pure bytes, no kernel.

`compile_rule(rule, targets)` turns a valid `FlowRule` into the attributes of one
flower filter (`CompiledFilter`); `CompiledFilter.new_request(ifindex)` is the body
of its RTM_NEWTFILTER. `parse_filter(message)` reads an RTM_NEWTFILTER answer of a
dump back (handle, pref, chain, flags, the first action's cookie and counters).
Neither touches a socket, so unit tests cover the encoding without a kernel; the
classifier and action codecs stand alone on `netlink` (pyroute2 0.9.7 has no
cls_flower, no tunnel_key and no action cookies).

The mapping (see `tc_backend` for where filters go):

- protocol: `802.1Q` when the match has `vlan_id` (then `ethertype` is the inner
  type), else `ethertype`, else the IP version of `src_ip`/`dst_ip`, else `all`;
- keys: MACs, vlan id, ip_proto, IPv4/IPv6 prefixes, TCP/UDP/SCTP ports, and the
  tunnel key id (`enc_key_id`) for `vxlan_vni`;
- actions, in order: Forward = `mirred egress redirect`, Drop = `gact drop`,
  Mirror = `mirred egress mirror`, Police = `police rate burst conform-exceed
  drop/pipe` (mtu 64 KiB), VlanPush = `vlan push id prio`, VlanPop = `vlan pop`,
  VxlanEncap = `tunnel_key set src_ip dst_ip id dst_port`, VxlanDecap =
  `tunnel_key unset`, Count = `gact pipe` (`gact ok` when last). The first action
  carries the rule's cookie (`rule_cookie`), and its counters are the rule's;
- flags: `skip_sw` for OffloadPolicy.HARDWARE_ONLY, `skip_hw` for SOFTWARE_ONLY.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import socket
import struct
from typing import TYPE_CHECKING, Final

from pyroute2.netlink.rtnl.tcmsg.common import calc_xmittime

from dpu_agent.errors import InvalidArgument
from dpu_agent.network import netlink as nl
from dpu_agent.network.model import (
    Count,
    Drop,
    FlowMatch,
    FlowRule,
    Forward,
    Mirror,
    OffloadPolicy,
    Police,
    VlanPop,
    VlanPush,
    VxlanDecap,
    VxlanEncap,
)
from dpu_agent.network.validate import check_rule, l3_ethertype

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from dpu_agent.network.model import Action, IPAddress

# linux/pkt_cls.h, tc_act/*.h
TCA_CLS_FLAGS_SKIP_HW = 1 << 0
TCA_CLS_FLAGS_SKIP_SW = 1 << 1
TCA_CLS_FLAGS_IN_HW = 1 << 2
TCA_ACT_KIND = 1
TCA_ACT_OPTIONS = 2
TCA_ACT_STATS = 4
TCA_ACT_COOKIE = 6
TCA_ACT_MAX_PRIO = 32
TCA_STATS_BASIC = 1
TCA_STATS_PKT64 = 8
TC_ACT_OK = 0
TC_ACT_SHOT = 2
TC_ACT_PIPE = 3
TC_ACT_STOLEN = 4
# flower
TCA_FLOWER_ACT = 3
TCA_FLOWER_KEY_ETH_DST = 4
TCA_FLOWER_KEY_ETH_SRC = 6
TCA_FLOWER_KEY_ETH_TYPE = 8
TCA_FLOWER_KEY_IP_PROTO = 9
TCA_FLOWER_KEY_IPV4_SRC = 10  # each address attribute is followed by its mask
TCA_FLOWER_KEY_IPV4_DST = 12
TCA_FLOWER_KEY_IPV6_SRC = 14
TCA_FLOWER_KEY_IPV6_DST = 16
TCA_FLOWER_KEY_TCP_SRC = 18
TCA_FLOWER_KEY_TCP_DST = 19
TCA_FLOWER_KEY_UDP_SRC = 20
TCA_FLOWER_KEY_UDP_DST = 21
TCA_FLOWER_FLAGS = 22
TCA_FLOWER_KEY_VLAN_ID = 23
TCA_FLOWER_KEY_VLAN_ETH_TYPE = 25
TCA_FLOWER_KEY_ENC_KEY_ID = 26
TCA_FLOWER_KEY_SCTP_SRC = 41
TCA_FLOWER_KEY_SCTP_DST = 42
# actions: parameters at 2 in every kind; the tcf_t timestamps at 1 (police: 6)
TCA_ACT_PARMS = 2
TCA_ACT_TM = 1
TCA_POLICE_TBF = 1
TCA_POLICE_RATE = 2
TCA_POLICE_RESULT = 5
TCA_POLICE_TM = 6
TCA_POLICE_RATE64 = 8
TCA_EGRESS_REDIR = 1
TCA_EGRESS_MIRROR = 2
TCA_VLAN_ACT_POP = 1
TCA_VLAN_ACT_PUSH = 2
TCA_VLAN_PUSH_VLAN_ID = 3
TCA_VLAN_PUSH_VLAN_PROTOCOL = 4
TCA_VLAN_PUSH_VLAN_PRIORITY = 6
TCA_TUNNEL_KEY_ACT_SET = 1
TCA_TUNNEL_KEY_ACT_RELEASE = 2
TCA_TUNNEL_KEY_ENC_IPV4_SRC = 3
TCA_TUNNEL_KEY_ENC_IPV4_DST = 4
TCA_TUNNEL_KEY_ENC_IPV6_SRC = 5
TCA_TUNNEL_KEY_ENC_IPV6_DST = 6
TCA_TUNNEL_KEY_ENC_KEY_ID = 7
TCA_TUNNEL_KEY_ENC_DST_PORT = 9
TC_LINKLAYER_ETHERNET = 1
# linux/if_ether.h, in.h
ETH_P_ALL = 0x0003
ETH_P_IP = 0x0800
ETH_P_IPV6 = 0x86DD
ETH_P_8021Q = 0x8100
ETH_P_8021AD = 0x88A8
IPPROTO_TCP = 6
IPPROTO_UDP = 17
IPPROTO_SCTP = 132

PORT_KEYS: Final = {
    IPPROTO_TCP: (TCA_FLOWER_KEY_TCP_SRC, TCA_FLOWER_KEY_TCP_DST),
    IPPROTO_UDP: (TCA_FLOWER_KEY_UDP_SRC, TCA_FLOWER_KEY_UDP_DST),
    IPPROTO_SCTP: (TCA_FLOWER_KEY_SCTP_SRC, TCA_FLOWER_KEY_SCTP_DST),
}
_U16: Final = struct.Struct("=H")
_BE16: Final = struct.Struct("!H")
_BE32: Final = struct.Struct("!I")
TCF_T: Final = struct.Struct("=QQQQ")  # install, lastuse, expires, firstuse (clock_t ago)
GNET_STATS_BASIC: Final = struct.Struct("=QI")  # bytes, packets
TC_GEN: Final = struct.Struct("=IIiii")  # index, capab, action, refcnt, bindcnt
TC_RATESPEC: Final = struct.Struct(
    "=BBHhHI"
)  # cell_log, linklayer, overhead, cell_align, mpu, rate
TC_POLICE_HEAD: Final = struct.Struct("=IiIII")  # index, action (exceed), limit, burst, mtu
TC_POLICE_TAIL: Final = struct.Struct("=iiI")  # refcnt, bindcnt, capab
POLICE_MTU: Final = 0xFFFF  # largest packet the policer accepts (GSO packets: per segment)

COOKIE_MAGIC: Final = b"dpu1"


def rule_cookie(rule_id: str) -> bytes:
    """The 16-byte tc action cookie that marks the filter of `rule_id` as ours."""
    return COOKIE_MAGIC + hashlib.sha256(rule_id.encode()).digest()[:12]


# ------------------------------------------------------------------ filters read back
@dataclasses.dataclass(frozen=True)
class Filter:
    """A classifier instance found on an ingress hook."""

    handle: int
    pref: int
    protocol: int
    chain: int
    kind: str
    flags: int = 0
    cookie: bytes | None = None
    packets: int = 0
    bytes: int = 0
    lastuse: int | None = None  # clock_t ticks since the first action last ran


def _first_action(options: dict[int, bytes]) -> dict[int, bytes]:
    actions = nl.parse_attrs(options.get(TCA_FLOWER_ACT, b""))
    if not actions:
        return {}
    return nl.parse_attrs(actions[min(actions)])


def parse_filter(message: bytes) -> Filter | None:
    """A filter from an RTM_NEWTFILTER message; None for a classifier's own entry."""
    _, _, handle, _, info = nl.TCMSG.unpack_from(message, nl.NLMSGHDR.size)
    if handle == 0:
        return None
    top = nl.parse_attrs(message, nl.NLMSGHDR.size + nl.TCMSG.size)
    kind = nl.asciiz(top.get(nl.TCA_KIND, b""))
    chain = struct.unpack("=I", top[nl.TCA_CHAIN])[0] if nl.TCA_CHAIN in top else 0
    pref, protocol = info >> 16, socket.ntohs(info & 0xFFFF)
    base = Filter(handle=handle, pref=pref, protocol=protocol, chain=chain, kind=kind)
    if kind != "flower":
        return base
    options = nl.parse_attrs(top.get(nl.TCA_OPTIONS, b""))
    flags = struct.unpack("=I", options[TCA_FLOWER_FLAGS])[0] if TCA_FLOWER_FLAGS in options else 0
    action = _first_action(options)
    stats = nl.parse_attrs(action.get(TCA_ACT_STATS, b""))
    byte_count, packets = 0, 0
    if len(basic := stats.get(TCA_STATS_BASIC, b"")) >= GNET_STATS_BASIC.size:
        byte_count, packets = GNET_STATS_BASIC.unpack_from(basic)
    if len(pkt64 := stats.get(TCA_STATS_PKT64, b"")) == 8:
        packets = struct.unpack("=Q", pkt64)[0]
    act_options = nl.parse_attrs(action.get(TCA_ACT_OPTIONS, b""))
    tm_kind = TCA_POLICE_TM if nl.asciiz(action.get(TCA_ACT_KIND, b"")) == "police" else TCA_ACT_TM
    tm = act_options.get(tm_kind, b"")
    return dataclasses.replace(
        base,
        flags=flags,
        cookie=action.get(TCA_ACT_COOKIE),
        packets=packets,
        bytes=byte_count,
        lastuse=TCF_T.unpack_from(tm)[1] if len(tm) >= TCF_T.size else None,
    )


# ------------------------------------------------------------------ rule -> flower
def _mac(value: str) -> bytes:
    return bytes.fromhex(value.replace(":", ""))


def _match_attrs(match: FlowMatch) -> tuple[int, list[tuple[int, bytes]]]:
    """(tc protocol, the flower key attributes as (type, payload)) of a valid match.

    A prefix is a key attribute followed by its mask attribute (type + 1).
    """
    ethertype = l3_ethertype(match)
    attrs: list[tuple[int, bytes]] = []
    if match.vlan_id is not None:
        protocol = ETH_P_8021Q
        attrs.append((TCA_FLOWER_KEY_ETH_TYPE, _BE16.pack(ETH_P_8021Q)))
        attrs.append((TCA_FLOWER_KEY_VLAN_ID, _U16.pack(match.vlan_id)))
        if ethertype is not None:
            attrs.append((TCA_FLOWER_KEY_VLAN_ETH_TYPE, _BE16.pack(ethertype)))
    else:
        protocol = ETH_P_ALL if ethertype is None else ethertype
        if ethertype is not None:
            attrs.append((TCA_FLOWER_KEY_ETH_TYPE, _BE16.pack(ethertype)))
    if match.dst_mac is not None:
        attrs.append((TCA_FLOWER_KEY_ETH_DST, _mac(match.dst_mac)))
    if match.src_mac is not None:
        attrs.append((TCA_FLOWER_KEY_ETH_SRC, _mac(match.src_mac)))
    _l3_l4_attrs(match, ethertype == ETH_P_IPV6, attrs)
    return protocol, attrs


def _l3_l4_attrs(match: FlowMatch, v6: bool, attrs: list[tuple[int, bytes]]) -> None:  # noqa: FBT001 - private
    for network, kinds in (
        (match.src_ip, (TCA_FLOWER_KEY_IPV6_SRC, TCA_FLOWER_KEY_IPV4_SRC)),
        (match.dst_ip, (TCA_FLOWER_KEY_IPV6_DST, TCA_FLOWER_KEY_IPV4_DST)),
    ):
        if network is not None:
            kind = kinds[0] if v6 else kinds[1]
            attrs.append((kind, network.network_address.packed))
            attrs.append((kind + 1, network.netmask.packed))
    if match.ip_protocol is not None:
        attrs.append((TCA_FLOWER_KEY_IP_PROTO, bytes((match.ip_protocol,))))
    if match.src_port is not None or match.dst_port is not None:
        src, dst = PORT_KEYS[match.ip_protocol or -1]
        if match.src_port is not None:
            attrs.append((src, _BE16.pack(match.src_port)))
        if match.dst_port is not None:
            attrs.append((dst, _BE16.pack(match.dst_port)))
    if match.vxlan_vni is not None:
        attrs.append((TCA_FLOWER_KEY_ENC_KEY_ID, _BE32.pack(match.vxlan_vni)))


def flower_match(match: FlowMatch) -> tuple[int, bytes, tuple[tuple[int, bytes], ...]]:
    """(tc protocol, flower key attributes, mask) of a match `validate.check_match` passed.

    The mask is which keys are present and the value of every mask attribute (the
    other keys are exact matches, a full mask, when present): what filters must share,
    with the protocol and skip flags, to share a pref (`mask_group`).
    """
    protocol, attrs = _match_attrs(match)
    keys = b"".join([nl.attr(kind, payload) for kind, payload in attrs])
    # `_match_attrs` appends the keys in one fixed order, so equal key sets give equal masks
    mask = tuple([(kind, value if kind in MASK_KEYS else b"") for kind, value in attrs])
    return protocol, keys, mask


def _police_parameters(police: Police) -> tuple[int, int]:
    """(bytes per second, burst in scheduler ticks) as tc computes them."""
    rate = police.rate_bps // 8
    burst = int(calc_xmittime(rate, police.burst_bytes))
    if burst > nl.U32_MAX:
        raise InvalidArgument(
            f"police: a burst of {police.burst_bytes} bytes lasts too long"
            f" at {police.rate_bps} bit/s"
        )
    return rate, burst


def _police(police: Police, conform: int) -> bytes:
    rate, burst = _police_parameters(police)
    cell_log = 0
    while (POLICE_MTU >> cell_log) > 255:
        cell_log += 1
    table = struct.pack(
        "=256I",
        *(min(int(calc_xmittime(rate, (i + 1) << cell_log)), nl.U32_MAX) for i in range(256)),
    )
    ratespec = TC_RATESPEC.pack(cell_log, TC_LINKLAYER_ETHERNET, 0, -1, 0, min(rate, nl.U32_MAX))
    tbf = (
        TC_POLICE_HEAD.pack(0, TC_ACT_SHOT, 0, burst, POLICE_MTU)
        + ratespec
        + bytes(TC_RATESPEC.size)
        + TC_POLICE_TAIL.pack(0, 0, 0)
    )
    attrs = nl.attr(TCA_POLICE_TBF, tbf) + nl.attr(TCA_POLICE_RATE, table)
    attrs += nl.u32(TCA_POLICE_RESULT, conform)
    if rate > nl.U32_MAX:
        attrs += nl.attr(TCA_POLICE_RATE64, struct.pack("=Q", rate))
    return attrs


def _tunnel_key(action: VxlanEncap | VxlanDecap, control: int) -> bytes:
    if isinstance(action, VxlanDecap):
        parms = TC_GEN.pack(0, 0, control, 0, 0) + struct.pack("=i", TCA_TUNNEL_KEY_ACT_RELEASE)
        return nl.attr(TCA_ACT_PARMS, parms)
    parms = TC_GEN.pack(0, 0, control, 0, 0) + struct.pack("=i", TCA_TUNNEL_KEY_ACT_SET)
    src, dst = (
        (TCA_TUNNEL_KEY_ENC_IPV4_SRC, TCA_TUNNEL_KEY_ENC_IPV4_DST)
        if action.src_ip.version == 4
        else (TCA_TUNNEL_KEY_ENC_IPV6_SRC, TCA_TUNNEL_KEY_ENC_IPV6_DST)
    )
    address: IPAddress
    attrs = nl.attr(TCA_ACT_PARMS, parms)
    for kind, address in ((src, action.src_ip), (dst, action.dst_ip)):
        attrs += nl.attr(kind, address.packed)
    attrs += nl.be32(TCA_TUNNEL_KEY_ENC_KEY_ID, action.vni)
    return attrs + nl.be16(TCA_TUNNEL_KEY_ENC_DST_PORT, action.dst_port)


def _vlan(action: VlanPush | VlanPop, control: int) -> bytes:
    if isinstance(action, VlanPop):
        parms = TC_GEN.pack(0, 0, control, 0, 0) + struct.pack("=i", TCA_VLAN_ACT_POP)
        return nl.attr(TCA_ACT_PARMS, parms)
    parms = TC_GEN.pack(0, 0, control, 0, 0) + struct.pack("=i", TCA_VLAN_ACT_PUSH)
    return (
        nl.attr(TCA_ACT_PARMS, parms)
        + nl.u16(TCA_VLAN_PUSH_VLAN_ID, action.vlan_id)
        + nl.be16(TCA_VLAN_PUSH_VLAN_PROTOCOL, ETH_P_8021Q)
        + nl.u8(TCA_VLAN_PUSH_VLAN_PRIORITY, action.priority)
    )


def _action(action: Action, *, last: bool, ifindex: Mapping[str, int]) -> tuple[str, bytes]:
    """(tc action kind, its options) for one action at its place in the list."""
    control = TC_ACT_OK if last else TC_ACT_PIPE
    if isinstance(action, (Forward, Mirror)):
        redirect = isinstance(action, Forward)
        parms = TC_GEN.pack(0, 0, TC_ACT_STOLEN if redirect else control, 0, 0)
        parms += struct.pack(
            "=iI", TCA_EGRESS_REDIR if redirect else TCA_EGRESS_MIRROR, ifindex[action.port]
        )
        return "mirred", nl.attr(TCA_ACT_PARMS, parms)
    if isinstance(action, (Drop, Count)):
        verdict = TC_ACT_SHOT if isinstance(action, Drop) else control
        return "gact", nl.attr(TCA_ACT_PARMS, TC_GEN.pack(0, 0, verdict, 0, 0))
    if isinstance(action, Police):
        return "police", _police(action, control)
    if isinstance(action, VlanPush | VlanPop):
        return "vlan", _vlan(action, control)
    return "tunnel_key", _tunnel_key(action, control)


def _actions(actions: Sequence[Action], ifindex: Mapping[str, int], cookie: bytes) -> bytes:
    encoded = b""
    for prio, action in enumerate(actions, start=1):
        kind, options = _action(action, last=prio == len(actions), ifindex=ifindex)
        attrs = nl.string(TCA_ACT_KIND, kind) + nl.nest(TCA_ACT_OPTIONS, options)
        if prio == 1:
            attrs += nl.attr(TCA_ACT_COOKIE, cookie)
        encoded += nl.nest(prio, attrs)
    return nl.nest(TCA_FLOWER_ACT, encoded)


@functools.lru_cache(maxsize=1024)
def _actions_around_cookie(
    actions: tuple[Action, ...], targets: tuple[tuple[str, int], ...]
) -> tuple[bytes, bytes]:
    """The encoded actions before and after the cookie's 16 bytes (rules share these)."""
    zeros = _actions(actions, dict(targets), bytes(16))
    ones = _actions(actions, dict(targets), b"\x01" * 16)
    at = next(i for i, (a, b) in enumerate(zip(zeros, ones, strict=True)) if a != b)
    return zeros[:at], zeros[at + 16 :]


def encode_actions(actions: Sequence[Action], ifindex: Mapping[str, int], cookie: bytes) -> bytes:
    """The TCA_FLOWER_ACT attribute of a rule's actions, its cookie on the first."""
    before, after = _actions_around_cookie(tuple(actions), tuple(sorted(ifindex.items())))
    return before + cookie + after


def skip_flags(policy: OffloadPolicy) -> int:
    """The flower flags of an offload policy (not ANY: the caller resolves it)."""
    if policy is OffloadPolicy.HARDWARE_ONLY:
        return TCA_CLS_FLAGS_SKIP_SW
    if policy is OffloadPolicy.SOFTWARE_ONLY:
        return TCA_CLS_FLAGS_SKIP_HW
    return 0


_KIND_FLOWER: Final = nl.string(nl.TCA_KIND, "flower")

# Mask attributes: each follows its key attribute (see `_match_attrs`).
MASK_KEYS: Final = frozenset(
    kind + 1
    for kind in (
        TCA_FLOWER_KEY_IPV4_SRC,
        TCA_FLOWER_KEY_IPV4_DST,
        TCA_FLOWER_KEY_IPV6_SRC,
        TCA_FLOWER_KEY_IPV6_DST,
    )
)


def mask_group(
    protocol: int, flags: int, mask: tuple[tuple[int, bytes], ...]
) -> tuple[object, ...]:
    """What filters must share to share a pref: protocol, skip flags and the mask."""
    return (protocol, flags, mask)


@dataclasses.dataclass(frozen=True)
class CompiledFilter:
    """One flower filter: where it goes on a port's ingress hook, and its options.

    `handle` is the rule's priority (`parse_filter` reads it back), `pref` where the
    filter goes (`layout` may put several rules in one), `group` what filters sharing
    a pref must have in common and `key` the match, which they must not share.
    """

    pref: int
    protocol: int
    options: bytes  # TCA_OPTIONS payload: flags, keys, actions
    chain: int = 0
    handle: int = 0
    group: tuple[object, ...] = ()
    key: bytes = b""
    cookie: bytes = b""

    def placed(self, pref: int) -> Filter:
        """This filter as a dump reads it back once it is added at `pref`."""
        return Filter(
            handle=self.handle,
            pref=pref,
            protocol=self.protocol,
            chain=self.chain,
            kind="flower",
            cookie=self.cookie,
        )

    def new_request(self, ifindex: int, pref: int | None = None) -> bytes:
        """The body of the RTM_NEWTFILTER that adds this filter to `ifindex`'s ingress.

        At `pref` if given, else at its own.
        """
        info = nl.tc_info(self.pref if pref is None else pref, self.protocol)
        body = nl.tcmsg(ifindex, self.handle, nl.INGRESS_PARENT, info)
        body += _KIND_FLOWER
        if self.chain:
            body += nl.u32(nl.TCA_CHAIN, self.chain)
        return body + nl.nest(nl.TCA_OPTIONS, self.options)


def action_ports(actions: Iterable[Action]) -> list[str]:
    """The ports a rule's forwards and mirrors send to."""
    return [a.port for a in actions if isinstance(a, (Forward, Mirror))]


def compile_rule(
    rule: FlowRule,
    targets: Mapping[str, int],
    default_offload: OffloadPolicy = OffloadPolicy.ANY,
    *,
    check: bool = True,
) -> CompiledFilter:
    """The flower filter of `rule`; InvalidArgument (with the reason) if it is not valid.

    `targets` gives the ifindex of every port in `action_ports(rule.actions)`;
    `default_offload` is the policy of a rule whose offload is ANY. `check=False`
    skips `validate.check_rule` for a caller that has just run it.
    """
    if check:
        check_rule(rule)
    protocol, keys, mask = flower_match(rule.match)
    policy = default_offload if rule.offload is OffloadPolicy.ANY else rule.offload
    flags = skip_flags(policy)
    cookie = rule_cookie(rule.rule_id)
    options = nl.u32(TCA_FLOWER_FLAGS, flags) + keys + encode_actions(rule.actions, targets, cookie)
    return CompiledFilter(
        pref=rule.priority,
        protocol=protocol,
        options=options,
        handle=rule.priority,
        group=mask_group(protocol, flags, mask),
        key=keys,
        cookie=cookie,
    )


def delete_request(ifindex: int, f: Filter) -> bytes:
    """The body of the RTM_DELTFILTER that removes filter `f` (as dumped) from `ifindex`."""
    body = nl.tcmsg(ifindex, f.handle, nl.INGRESS_PARENT, nl.tc_info(f.pref, f.protocol))
    body += nl.string(nl.TCA_KIND, f.kind)
    if f.chain:
        body += nl.u32(nl.TCA_CHAIN, f.chain)
    return body


def dump_request(ifindex: int, pref: int = 0) -> bytes:
    """The body of the RTM_GETTFILTER dump of `ifindex`'s ingress (one pref when > 0)."""
    return nl.tcmsg(ifindex, 0, nl.INGRESS_PARENT, nl.tc_info(pref))

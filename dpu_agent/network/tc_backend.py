"""Linux tc flower datapath: one flow rule is one flower filter on its port's ingress.

`TcFlowBackend` implements `FlowBackend` with the kernel's traffic control: on
BlueField in switchdev mode the filters are offloaded to the embedded switch, on any
other Linux (and in the test VM) the kernel runs them in software.

How a `FlowRule` becomes a filter
---------------------------------

- hook: a `clsact` qdisc on `rule.ingress_port`, created when missing (an existing
  `clsact` or `ingress` qdisc is used as it is; the backend never deletes a qdisc);
- the filter: `tc filter add dev PORT ingress pref PRIORITY protocol PROTO flower ...`,
  chain 0, one per (port, priority): anything already at that priority is refused
  with AlreadyExists;
- protocol: `802.1Q` when the match has `vlan_id` (then `ethertype` is the inner
  type), else `ethertype`, else the IP version of `src_ip`/`dst_ip`, else `all`.
  flower silently ignores `ip_proto` without an IP ethertype and L4 ports without
  TCP/UDP/SCTP, so such matches are refused here with InvalidArgument instead of
  becoming wider rules than asked for;
- keys: MACs, vlan id, ip_proto, IPv4/IPv6 prefixes, TCP/UDP/SCTP ports, and the
  tunnel key id (`enc_key_id`) for `vxlan_vni`;
- actions, in order: Forward = `mirred egress redirect`, Drop = `gact drop`,
  Mirror = `mirred egress mirror`, Police = `police rate burst conform-exceed
  drop/pipe` (mtu 64 KiB), VlanPush = `vlan push id prio`, VlanPop = `vlan pop`,
  VxlanEncap = `tunnel_key set src_ip dst_ip id dst_port`, VxlanDecap =
  `tunnel_key unset`, Count = `gact pipe` (`gact ok` when last). Forward and Drop
  must come last; VxlanEncap must be followed by a Forward (to the vxlan port). A
  rule that ends with neither Forward nor Drop lets the packet go on into the
  port's normal receive path. Every action counts: the first action's counters are
  the rule's;
- flags: `skip_sw` for OffloadPolicy.HARDWARE_ONLY, `skip_hw` for SOFTWARE_ONLY,
  none for ANY (rules at ANY take the backend's `default_offload`).

Which filters are ours: action cookies
--------------------------------------

The first action of every filter the backend installs carries a 16-byte tc action
cookie: `b"dpu1"` followed by the first 12 bytes of SHA-256(rule_id)
(`rule_cookie()`; `tc filter show` prints it as `cookie 64707531...`). The kernel
keeps it with the filter, so ours are recognised after an agent restart too:

- `remove()` and `counters()` look for the cookie of `rule.rule_id` at (port,
  priority), so they work for rules installed by an earlier process, and never
  touch a filter someone else put there;
- `installed()` reports `rule_id` for cookies of rules this object installed (or
  was told about with `remember()`), the string `"cookie:<32 hex digits>"` for
  other `dpu1` cookies (installed by an earlier process: match them against
  `rule_cookie(rule_id).hex()` of the persisted rules, or call `remember()` with
  those ids first), and None for filters without our cookie (made by hand, by
  other tools).

Kernel access
-------------

pyroute2 0.9.7 has no flower classifier, no tunnel_key action and no action
cookies, and its synchronous API gives every calling thread its own socket and
event loop (~0.45 ms per request). So this module speaks rtnetlink itself over one
NETLINK_ROUTE socket with extended acks (the kernel's reason for a refusal ends up
in the error message), guarded by one lock: every method is thread-safe and
callable from `asyncio.to_thread`. pyroute2 provides what it has: entering a named
network namespace (`netns=`: the socket is opened in a short-lived thread that
`setns()`-es into it), decoding link messages (`ifinfmsg`: state, MAC, MTU,
IFLA_STATS64) and tc's token-bucket arithmetic for the policer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fnmatch
import hashlib
import os
import re
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING, Self

from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg
from pyroute2.netlink.rtnl.tcmsg.common import calc_xmittime
from pyroute2.netns import setns

from dpu_agent.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from dpu_agent.network.backend import FlowBackend
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
    PortCounters,
    PortInfo,
    RuleCounters,
    VlanPop,
    VlanPush,
    VxlanDecap,
    VxlanEncap,
    port_kind,
)

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Mapping, Sequence
    from types import TracebackType

    from dpu_agent.network.model import Action, IPAddress, IPNetwork

# ------------------------------------------------------------------ kernel ABI
# linux/netlink.h
NETLINK_ROUTE = 0
SOL_NETLINK = 270
NETLINK_CAP_ACK = 10
NETLINK_EXT_ACK = 11
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLM_F_DUMP_INTR = 0x10
NLM_F_DUMP = 0x300
NLM_F_EXCL = 0x200
NLM_F_CREATE = 0x400
NLM_F_CAPPED = 0x100  # in an error message: the request is not echoed
NLM_F_ACK_TLVS = 0x200  # in an error message: extended ack attributes follow
NLMSGERR_ATTR_MSG = 1
NLA_F_NESTED = 0x8000
NLA_TYPE_MASK = 0x3FFF
# linux/rtnetlink.h, linux/if_link.h
RTM_NEWLINK = 16
RTM_GETLINK = 18
RTM_NEWQDISC = 36
RTM_NEWTFILTER = 44
RTM_DELTFILTER = 45
RTM_GETTFILTER = 46
IFLA_IFNAME = 3
IFLA_EXT_MASK = 29
RTEXT_FILTER_SKIP_STATS = 1 << 3
IFF_UP = 0x1
IFF_LOWER_UP = 0x10000
IFNAMSIZ = 16
# linux/pkt_sched.h, linux/pkt_cls.h
TCA_KIND = 1
TCA_OPTIONS = 2
TCA_CHAIN = 11
TC_H_CLSACT = 0xFFFFFFF1
CLSACT_HANDLE = 0xFFFF0000
INGRESS_PARENT = 0xFFFFFFF2  # TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_INGRESS)
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

_PORT_KEYS = {
    IPPROTO_TCP: (TCA_FLOWER_KEY_TCP_SRC, TCA_FLOWER_KEY_TCP_DST),
    IPPROTO_UDP: (TCA_FLOWER_KEY_UDP_SRC, TCA_FLOWER_KEY_UDP_DST),
    IPPROTO_SCTP: (TCA_FLOWER_KEY_SCTP_SRC, TCA_FLOWER_KEY_SCTP_DST),
}
_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_IFINFOMSG = struct.Struct("=BxHiII")  # family, type, index, flags, change
_TCMSG = struct.Struct("=BxxxiIII")  # family, ifindex, handle, parent, info
_TCF_T = struct.Struct("=QQQQ")  # install, lastuse, expires, firstuse (clock_t ago)
_GNET_STATS_BASIC = struct.Struct("=QI")  # bytes, packets
_TC_GEN = struct.Struct("=IIiii")  # index, capab, action, refcnt, bindcnt
_TC_RATESPEC = struct.Struct("=BBHhHI")  # cell_log, linklayer, overhead, cell_align, mpu, rate
_TC_POLICE_HEAD = struct.Struct("=IiIII")  # index, action (exceed), limit, burst, mtu
_TC_POLICE_TAIL = struct.Struct("=iiI")  # refcnt, bindcnt, capab
_RECV_SIZE = 1 << 16
_TIMEOUT_S = 10.0
_DUMP_ATTEMPTS = 3
_POLICE_MTU = 0xFFFF  # largest packet the policer accepts (GSO packets: per segment)
_U32_MAX = 0xFFFFFFFF
_USER_HZ = os.sysconf("SC_CLK_TCK")

_MAC = re.compile(r"[0-9a-fA-F]{2}(:[0-9a-fA-F]{2}){5}")

COOKIE_MAGIC = b"dpu1"
COOKIE_PREFIX = "cookie:"


def rule_cookie(rule_id: str) -> bytes:
    """The 16-byte tc action cookie that marks the filter of `rule_id` as ours."""
    return COOKIE_MAGIC + hashlib.sha256(rule_id.encode()).digest()[:12]


# ------------------------------------------------------------------ attributes
def _attr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _nest(kind: int, *children: bytes) -> bytes:
    return _attr(kind | NLA_F_NESTED, b"".join(children))


def _u8(kind: int, value: int) -> bytes:
    return _attr(kind, struct.pack("=B", value))


def _u16(kind: int, value: int) -> bytes:
    return _attr(kind, struct.pack("=H", value))


def _be16(kind: int, value: int) -> bytes:
    return _attr(kind, struct.pack("!H", value))


def _u32(kind: int, value: int) -> bytes:
    return _attr(kind, struct.pack("=I", value))


def _be32(kind: int, value: int) -> bytes:
    return _attr(kind, struct.pack("!I", value))


def _string(kind: int, value: str) -> bytes:
    return _attr(kind, value.encode() + b"\0")


def _attrs(data: bytes, offset: int = 0) -> dict[int, bytes]:
    """Attributes from `offset` to the end, by type (flags masked; last one wins)."""
    found: dict[int, bytes] = {}
    end = len(data)
    while offset + 4 <= end:
        length, kind = struct.unpack_from("=HH", data, offset)
        if length < 4:
            break
        found[kind & NLA_TYPE_MASK] = data[offset + 4 : offset + length]
        offset += (length + 3) & ~3
    return found


def _asciiz(value: bytes) -> str:
    return value.split(b"\0", 1)[0].decode(errors="replace")


# ------------------------------------------------------------------ netlink socket
class _KernelError(Exception):
    """The kernel answered a request with an error."""

    def __init__(self, code: int, message: str) -> None:
        self.code = code
        self.message = message
        reason = os.strerror(code)
        super().__init__(f"{reason}: {message}" if message else reason)


class _DumpInterrupted(Exception):
    """The kernel's state changed during a dump (NLM_F_DUMP_INTR); dump again."""


def _open_socket(netns: str | None) -> socket.socket:
    """A NETLINK_ROUTE socket, in the named network namespace when given."""
    if netns is None:
        return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
    outcome: list[socket.socket | BaseException] = []

    def enter() -> None:  # setns() moves only this (short-lived) thread
        try:
            setns(netns, flags=0)
            outcome.append(socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE))
        except BaseException as exc:  # noqa: BLE001 - handed to the calling thread
            outcome.append(exc)

    thread = threading.Thread(target=enter, name=f"netns-{netns}")
    thread.start()
    thread.join()
    result = outcome[0]
    if isinstance(result, BaseException):
        raise Unavailable(f"cannot enter network namespace {netns!r}: {result}")
    return result


def _extack(payload: bytes, flags: int) -> str:
    """The kernel's message in an NLMSG_ERROR payload (error, request, attributes)."""
    if not flags & NLM_F_ACK_TLVS or len(payload) < 20:
        return ""
    echoed = 16 if flags & NLM_F_CAPPED else struct.unpack_from("=I", payload, 4)[0]
    message = _attrs(payload, 4 + ((echoed + 3) & ~3)).get(NLMSGERR_ATTR_MSG)
    return _asciiz(message) if message else ""


class _Rtnl:
    """Requests and answers on one NETLINK_ROUTE socket (not thread-safe by itself)."""

    def __init__(self, netns: str | None) -> None:
        self._sock = _open_socket(netns)
        try:
            self._sock.setsockopt(SOL_NETLINK, NETLINK_EXT_ACK, 1)
            self._sock.setsockopt(SOL_NETLINK, NETLINK_CAP_ACK, 1)
            self._sock.settimeout(_TIMEOUT_S)
            self._sock.bind((0, 0))
        except OSError as exc:
            self._sock.close()
            raise Unavailable(f"rtnetlink socket: {exc}") from exc
        self._seq = 0

    def close(self) -> None:
        self._sock.close()

    def request(self, msg_type: int, flags: int, body: bytes) -> list[bytes]:
        """Send one request; its answers (whole messages), or _KernelError.

        A dump ends with NLMSG_DONE, an acked request with NLMSG_ERROR (0 = success),
        any other request with its one answer.
        """
        self._seq = (self._seq + 1) & _U32_MAX
        seq = self._seq
        header = _NLMSGHDR.pack(_NLMSGHDR.size + len(body), msg_type, flags, seq, 0)
        try:
            self._sock.send(header + body)
            return self._answers(seq, flags)
        except OSError as exc:  # includes the socket timeout
            raise Unavailable(f"rtnetlink: {exc}") from exc

    def dump(self, msg_type: int, body: bytes) -> list[bytes]:
        """A dump request, repeated when the kernel says it was interrupted."""
        for _ in range(_DUMP_ATTEMPTS):
            with contextlib.suppress(_DumpInterrupted):
                return self.request(msg_type, NLM_F_REQUEST | NLM_F_DUMP, body)
        raise Unavailable("rtnetlink dump interrupted repeatedly (the datapath keeps changing)")

    def _answers(self, seq: int, flags: int) -> list[bytes]:
        answers: list[bytes] = []
        interrupted = False
        while True:
            data = self._sock.recv(_RECV_SIZE)
            offset = 0
            while offset + _NLMSGHDR.size <= len(data):
                length, kind, mflags, mseq, _ = _NLMSGHDR.unpack_from(data, offset)
                message = data[offset : offset + length]
                offset += max((length + 3) & ~3, _NLMSGHDR.size)
                if mseq != seq:
                    continue  # a late answer to an earlier request that timed out
                interrupted |= bool(mflags & NLM_F_DUMP_INTR)
                if kind in (NLMSG_ERROR, NLMSG_DONE):
                    code = -struct.unpack_from("=i", message, 16)[0] if length >= 20 else 0
                    if code and kind == NLMSG_ERROR:
                        raise _KernelError(code, _extack(message[16:], mflags))
                    if code:
                        raise _KernelError(code, "")
                    if interrupted:
                        raise _DumpInterrupted
                    return answers
                answers.append(message)
                if not flags & (NLM_F_DUMP | NLM_F_ACK):
                    return answers


# ------------------------------------------------------------------ filters read back
@dataclasses.dataclass(frozen=True)
class _Filter:
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
    actions = _attrs(options.get(TCA_FLOWER_ACT, b""))
    if not actions:
        return {}
    return _attrs(actions[min(actions)])


def _parse_filter(message: bytes) -> _Filter | None:
    """A filter from an RTM_NEWTFILTER message; None for a classifier's own entry."""
    _, _, handle, _, info = _TCMSG.unpack_from(message, _NLMSGHDR.size)
    if handle == 0:
        return None
    top = _attrs(message, _NLMSGHDR.size + _TCMSG.size)
    kind = _asciiz(top.get(TCA_KIND, b""))
    chain = struct.unpack("=I", top[TCA_CHAIN])[0] if TCA_CHAIN in top else 0
    pref, protocol = info >> 16, socket.ntohs(info & 0xFFFF)
    base = _Filter(handle=handle, pref=pref, protocol=protocol, chain=chain, kind=kind)
    if kind != "flower":
        return base
    options = _attrs(top.get(TCA_OPTIONS, b""))
    flags = struct.unpack("=I", options[TCA_FLOWER_FLAGS])[0] if TCA_FLOWER_FLAGS in options else 0
    action = _first_action(options)
    stats = _attrs(action.get(TCA_ACT_STATS, b""))
    byte_count, packets = 0, 0
    if len(basic := stats.get(TCA_STATS_BASIC, b"")) >= _GNET_STATS_BASIC.size:
        byte_count, packets = _GNET_STATS_BASIC.unpack_from(basic)
    if len(pkt64 := stats.get(TCA_STATS_PKT64, b"")) == 8:
        packets = struct.unpack("=Q", pkt64)[0]
    act_options = _attrs(action.get(TCA_ACT_OPTIONS, b""))
    tm_kind = TCA_POLICE_TM if _asciiz(action.get(TCA_ACT_KIND, b"")) == "police" else TCA_ACT_TM
    tm = act_options.get(tm_kind, b"")
    return dataclasses.replace(
        base,
        flags=flags,
        cookie=action.get(TCA_ACT_COOKIE),
        packets=packets,
        bytes=byte_count,
        lastuse=_TCF_T.unpack_from(tm)[1] if len(tm) >= _TCF_T.size else None,
    )


# ------------------------------------------------------------------ rule -> flower
def _mac(value: str, what: str) -> bytes:
    if not _MAC.fullmatch(value):
        raise InvalidArgument(f"{what} {value!r} is not a MAC address (aa:bb:cc:dd:ee:ff)")
    return bytes.fromhex(value.replace(":", ""))


def _prefix(kind: int, network: IPNetwork) -> bytes:
    return _attr(kind, network.network_address.packed) + _attr(kind + 1, network.netmask.packed)


def _check_range(value: int | None, low: int, high: int, what: str) -> None:
    if value is not None and not low <= value <= high:
        raise InvalidArgument(f"{what} {value} is outside {low}..{high}")


def _l3_ethertype(match: FlowMatch) -> int | None:
    """The ethertype the rule matches below any VLAN tag (given, or implied by the IPs)."""
    versions = {net.version for net in (match.src_ip, match.dst_ip) if net is not None}
    if len(versions) > 1:
        raise InvalidArgument("src_ip and dst_ip are of different IP versions")
    implied = {4: ETH_P_IP, 6: ETH_P_IPV6}[versions.pop()] if versions else None
    if match.ethertype is None:
        return implied
    if implied is not None and match.ethertype != implied:
        raise InvalidArgument(
            f"ethertype {match.ethertype:#06x} does not carry the IP version of src_ip/dst_ip"
        )
    return match.ethertype


def _check_match(match: FlowMatch) -> None:
    _check_range(match.ethertype, 0, 0xFFFF, "ethertype")
    _check_range(match.vlan_id, 0, 4094, "vlan_id")
    _check_range(match.ip_protocol, 0, 255, "ip_protocol")
    _check_range(match.src_port, 0, 0xFFFF, "src_port")
    _check_range(match.dst_port, 0, 0xFFFF, "dst_port")
    _check_range(match.vxlan_vni, 0, (1 << 24) - 1, "vxlan_vni")
    if match.vlan_id is not None and match.ethertype in (ETH_P_8021Q, ETH_P_8021AD):
        raise InvalidArgument("with vlan_id, ethertype is the type inside the tag (no QinQ)")


def _l4_keys(match: FlowMatch, ethertype: int | None) -> bytes:
    keys = b""
    if match.ip_protocol is not None:
        if ethertype not in (ETH_P_IP, ETH_P_IPV6):
            raise InvalidArgument(
                "ip_protocol needs ethertype 0x0800 or 0x86dd (or an IP prefix to imply it);"
                " flower would ignore it and match every protocol"
            )
        keys += _u8(TCA_FLOWER_KEY_IP_PROTO, match.ip_protocol)
    if match.src_port is None and match.dst_port is None:
        return keys
    port_keys = _PORT_KEYS.get(match.ip_protocol or -1)
    if port_keys is None:
        raise InvalidArgument("src_port/dst_port need ip_protocol 6 (TCP), 17 (UDP) or 132 (SCTP)")
    if match.src_port is not None:
        keys += _be16(port_keys[0], match.src_port)
    if match.dst_port is not None:
        keys += _be16(port_keys[1], match.dst_port)
    return keys


def flower_match(match: FlowMatch) -> tuple[int, bytes]:
    """(tc protocol, flower key attributes) of a match; InvalidArgument if flower cannot.

    Public for tests and tools that want the encoding without a kernel.
    """
    _check_match(match)
    ethertype = _l3_ethertype(match)
    keys = b""
    if match.vlan_id is not None:
        protocol = ETH_P_8021Q
        keys += _be16(TCA_FLOWER_KEY_ETH_TYPE, ETH_P_8021Q)
        keys += _u16(TCA_FLOWER_KEY_VLAN_ID, match.vlan_id)
        if ethertype is not None:
            keys += _be16(TCA_FLOWER_KEY_VLAN_ETH_TYPE, ethertype)
    else:
        protocol = ETH_P_ALL if ethertype is None else ethertype
        if ethertype is not None:
            keys += _be16(TCA_FLOWER_KEY_ETH_TYPE, ethertype)
    if match.dst_mac is not None:
        keys += _attr(TCA_FLOWER_KEY_ETH_DST, _mac(match.dst_mac, "dst_mac"))
    if match.src_mac is not None:
        keys += _attr(TCA_FLOWER_KEY_ETH_SRC, _mac(match.src_mac, "src_mac"))
    v6 = ethertype == ETH_P_IPV6
    if match.src_ip is not None:
        keys += _prefix(TCA_FLOWER_KEY_IPV6_SRC if v6 else TCA_FLOWER_KEY_IPV4_SRC, match.src_ip)
    if match.dst_ip is not None:
        keys += _prefix(TCA_FLOWER_KEY_IPV6_DST if v6 else TCA_FLOWER_KEY_IPV4_DST, match.dst_ip)
    keys += _l4_keys(match, ethertype)
    if match.vxlan_vni is not None:
        keys += _be32(TCA_FLOWER_KEY_ENC_KEY_ID, match.vxlan_vni)
    return protocol, keys


def _check_actions(actions: Sequence[Action]) -> None:
    if not actions:
        raise InvalidArgument("a rule needs at least one action (Count to only count)")
    if len(actions) > TCA_ACT_MAX_PRIO:
        raise InvalidArgument(f"a rule has at most {TCA_ACT_MAX_PRIO} actions")
    for index, action in enumerate(actions):
        last = index == len(actions) - 1
        if isinstance(action, Forward | Drop) and not last:
            raise InvalidArgument(f"{type(action).__name__} must be the last action")
        if isinstance(action, VxlanEncap):
            if not any(isinstance(later, Forward) for later in actions[index + 1 :]):
                raise InvalidArgument("VxlanEncap must be followed by a Forward to a vxlan port")
            if action.src_ip.version != action.dst_ip.version:
                raise InvalidArgument("VxlanEncap src_ip and dst_ip are of different IP versions")
            _check_range(action.vni, 0, (1 << 24) - 1, "VxlanEncap vni")
            _check_range(action.dst_port, 1, 0xFFFF, "VxlanEncap dst_port")
        if isinstance(action, VlanPush):
            _check_range(action.vlan_id, 0, 4094, "VlanPush vlan_id")
            _check_range(action.priority, 0, 7, "VlanPush priority")
        if isinstance(action, Police):
            _police_parameters(action)


def _action_ports(actions: Iterable[Action]) -> list[str]:
    return [a.port for a in actions if isinstance(a, Forward | Mirror)]


def _police_parameters(police: Police) -> tuple[int, int]:
    """(bytes per second, burst in scheduler ticks) as tc computes them."""
    rate = police.rate_bps // 8
    if rate < 1 or rate >= 1 << 64:
        raise InvalidArgument(f"Police rate_bps {police.rate_bps} is outside 8..2^67")
    if police.burst_bytes < 1:
        raise InvalidArgument("Police burst_bytes must be positive")
    burst = int(calc_xmittime(rate, police.burst_bytes))
    if burst > _U32_MAX:
        raise InvalidArgument(f"Police burst of {police.burst_bytes} bytes is too long a time")
    return rate, burst


def _police(police: Police, conform: int) -> bytes:
    rate, burst = _police_parameters(police)
    cell_log = 0
    while (_POLICE_MTU >> cell_log) > 255:
        cell_log += 1
    table = struct.pack(
        "=256I",
        *(min(int(calc_xmittime(rate, (i + 1) << cell_log)), _U32_MAX) for i in range(256)),
    )
    ratespec = _TC_RATESPEC.pack(cell_log, TC_LINKLAYER_ETHERNET, 0, -1, 0, min(rate, _U32_MAX))
    tbf = (
        _TC_POLICE_HEAD.pack(0, TC_ACT_SHOT, 0, burst, _POLICE_MTU)
        + ratespec
        + bytes(_TC_RATESPEC.size)
        + _TC_POLICE_TAIL.pack(0, 0, 0)
    )
    attrs = _attr(TCA_POLICE_TBF, tbf) + _attr(TCA_POLICE_RATE, table)
    attrs += _u32(TCA_POLICE_RESULT, conform)
    if rate > _U32_MAX:
        attrs += _attr(TCA_POLICE_RATE64, struct.pack("=Q", rate))
    return attrs


def _tunnel_key(action: VxlanEncap | VxlanDecap, control: int) -> bytes:
    if isinstance(action, VxlanDecap):
        parms = _TC_GEN.pack(0, 0, control, 0, 0) + struct.pack("=i", TCA_TUNNEL_KEY_ACT_RELEASE)
        return _attr(TCA_ACT_PARMS, parms)
    parms = _TC_GEN.pack(0, 0, control, 0, 0) + struct.pack("=i", TCA_TUNNEL_KEY_ACT_SET)
    src, dst = (
        (TCA_TUNNEL_KEY_ENC_IPV4_SRC, TCA_TUNNEL_KEY_ENC_IPV4_DST)
        if action.src_ip.version == 4
        else (TCA_TUNNEL_KEY_ENC_IPV6_SRC, TCA_TUNNEL_KEY_ENC_IPV6_DST)
    )
    address: IPAddress
    attrs = _attr(TCA_ACT_PARMS, parms)
    for kind, address in ((src, action.src_ip), (dst, action.dst_ip)):
        attrs += _attr(kind, address.packed)
    attrs += _be32(TCA_TUNNEL_KEY_ENC_KEY_ID, action.vni)
    return attrs + _be16(TCA_TUNNEL_KEY_ENC_DST_PORT, action.dst_port)


def _vlan(action: VlanPush | VlanPop, control: int) -> bytes:
    if isinstance(action, VlanPop):
        parms = _TC_GEN.pack(0, 0, control, 0, 0) + struct.pack("=i", TCA_VLAN_ACT_POP)
        return _attr(TCA_ACT_PARMS, parms)
    parms = _TC_GEN.pack(0, 0, control, 0, 0) + struct.pack("=i", TCA_VLAN_ACT_PUSH)
    return (
        _attr(TCA_ACT_PARMS, parms)
        + _u16(TCA_VLAN_PUSH_VLAN_ID, action.vlan_id)
        + _be16(TCA_VLAN_PUSH_VLAN_PROTOCOL, ETH_P_8021Q)
        + _u8(TCA_VLAN_PUSH_VLAN_PRIORITY, action.priority)
    )


def _action(action: Action, last: bool, ifindex: Mapping[str, int]) -> tuple[str, bytes]:  # noqa: FBT001
    """(tc action kind, its options) for one action at its place in the list."""
    control = TC_ACT_OK if last else TC_ACT_PIPE
    if isinstance(action, Forward | Mirror):
        redirect = isinstance(action, Forward)
        parms = _TC_GEN.pack(0, 0, TC_ACT_STOLEN if redirect else control, 0, 0)
        parms += struct.pack(
            "=iI", TCA_EGRESS_REDIR if redirect else TCA_EGRESS_MIRROR, ifindex[action.port]
        )
        return "mirred", _attr(TCA_ACT_PARMS, parms)
    if isinstance(action, Drop | Count):
        verdict = TC_ACT_SHOT if isinstance(action, Drop) else control
        return "gact", _attr(TCA_ACT_PARMS, _TC_GEN.pack(0, 0, verdict, 0, 0))
    if isinstance(action, Police):
        return "police", _police(action, control)
    if isinstance(action, VlanPush | VlanPop):
        return "vlan", _vlan(action, control)
    return "tunnel_key", _tunnel_key(action, control)


def _actions(actions: Sequence[Action], ifindex: Mapping[str, int], cookie: bytes) -> bytes:
    encoded = b""
    for prio, action in enumerate(actions, start=1):
        kind, options = _action(action, prio == len(actions), ifindex)
        attrs = _string(TCA_ACT_KIND, kind) + _nest(TCA_ACT_OPTIONS, options)
        if prio == 1:
            attrs += _attr(TCA_ACT_COOKIE, cookie)
        encoded += _nest(prio, attrs)
    return _nest(TCA_FLOWER_ACT, encoded)


def _skip_flags(policy: OffloadPolicy) -> int:
    if policy is OffloadPolicy.HARDWARE_ONLY:
        return TCA_CLS_FLAGS_SKIP_SW
    if policy is OffloadPolicy.SOFTWARE_ONLY:
        return TCA_CLS_FLAGS_SKIP_HW
    return 0


def _tcmsg(ifindex: int, handle: int, parent: int, info: int) -> bytes:
    return _TCMSG.pack(socket.AF_UNSPEC, ifindex, handle, parent, info)


def _info(pref: int, protocol: int = 0) -> int:
    return (pref << 16) | socket.htons(protocol)


# ------------------------------------------------------------------ the backend
class TcFlowBackend(FlowBackend):
    """Flow rules as tc flower filters on the ingress of managed netdevs.

    Args:
        ports: glob patterns (fnmatch, case-sensitive) of the netdev names the agent
            manages, e.g. ("p0", "p1", "pf*", "rep*"). Rules are installed on, and
            `ports()`/`installed()` report, only these; Forward and Mirror may name
            any netdev (e.g. a vxlan device).
        netns: a named network namespace (/run/netns/NAME) to work in; None = ours.
        default_offload: the policy for rules whose `offload` is ANY.

    See the module documentation for the mapping, cookies and limits.
    """

    def __init__(
        self,
        ports: Sequence[str],
        netns: str | None = None,
        default_offload: OffloadPolicy = OffloadPolicy.ANY,
    ) -> None:
        self._patterns = tuple(ports)
        self._default_offload = default_offload
        self._lock = threading.Lock()
        self._rule_ids: dict[bytes, str] = {}
        self._rtnl = _Rtnl(netns)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @staticmethod
    def rule_cookie(rule_id: str) -> bytes:
        """The tc action cookie of `rule_id` (see the module documentation)."""
        return rule_cookie(rule_id)

    def remember(self, rule_ids: Iterable[str]) -> None:
        """Let `installed()` name filters of these rules (installed by an earlier process)."""
        with self._lock:
            self._rule_ids.update((rule_cookie(rule_id), rule_id) for rule_id in rule_ids)

    def managed(self, name: str) -> bool:
        """Whether a netdev name matches the managed patterns."""
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self._patterns)

    # The FlowBackend interface.
    def ports(self) -> list[PortInfo]:
        """Managed netdevs: state, MAC, MTU and 64-bit counters, by name."""
        with self._kernel("listing ports"):
            messages = self._rtnl.dump(RTM_GETLINK, _IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0))
        found = []
        for message in messages:
            link = ifinfmsg(message)
            link.decode()
            name = link.get("ifname")
            if not isinstance(name, str) or not self.managed(name):
                continue
            stats = link.get("stats64") or {}
            lower_up = (link["flags"] & (IFF_UP | IFF_LOWER_UP)) == IFF_UP | IFF_LOWER_UP
            state = link.get("operstate")
            found.append(
                PortInfo(
                    name=name,
                    kind=port_kind(name),
                    up=state == "UP" or (state == "UNKNOWN" and lower_up),
                    mac=str(link.get("address") or ""),
                    mtu=int(link.get("mtu") or 0),
                    counters=PortCounters(
                        **{
                            f.name: int(stats.get(f.name, 0))
                            for f in dataclasses.fields(PortCounters)
                        }
                    ),
                )
            )
        return sorted(found, key=lambda port: port.name)

    def install(self, rule: FlowRule) -> None:
        """Add the rule's flower filter; all of it or nothing.

        Raises:
            InvalidArgument: the rule cannot be expressed as one flower filter.
            NotFound: the ingress port is not managed or absent, or a Forward/Mirror
                port does not exist.
            AlreadyExists: a filter (ours or not) is at (ingress_port, priority).
            FailedPrecondition: the kernel refused the filter (its reason is in the
                message); no filter is left behind. A clsact qdisc created for the
                rule stays on the port.
            Unavailable: rtnetlink could not be reached.
        """
        _check_range(rule.priority, 1, 0xFFFF, "priority")
        protocol, keys = flower_match(rule.match)
        _check_actions(rule.actions)
        policy = self._default_offload if rule.offload is OffloadPolicy.ANY else rule.offload
        cookie = rule_cookie(rule.rule_id)
        with self._kernel(f"installing rule {rule.rule_id!r}"):
            ifindex = self._managed_ifindex(rule.ingress_port)
            targets = {name: self._target_ifindex(name) for name in _action_ports(rule.actions)}
            if self._filters(ifindex, rule.priority):
                raise AlreadyExists(
                    f"{rule.ingress_port} already has a filter at priority {rule.priority}"
                )
            options = (
                _u32(TCA_FLOWER_FLAGS, _skip_flags(policy))
                + keys
                + _actions(rule.actions, targets, cookie)
            )
            body = _tcmsg(ifindex, 0, INGRESS_PARENT, _info(rule.priority, protocol))
            body += _string(TCA_KIND, "flower") + _nest(TCA_OPTIONS, options)
            try:
                self._ensure_clsact(ifindex)
                self._rtnl.request(
                    RTM_NEWTFILTER, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL, body
                )
            except _KernelError as exc:
                with contextlib.suppress(_KernelError):  # in case; normally there is none
                    self._delete_ours(ifindex, rule.priority, cookie)
                raise FailedPrecondition(
                    f"the kernel refused rule {rule.rule_id!r} on {rule.ingress_port}: {exc}"
                ) from exc
            self._rule_ids[cookie] = rule.rule_id

    def remove(self, rule: FlowRule) -> None:
        """Delete the rule's filter (found by its cookie); no error if it is gone.

        A filter at (ingress_port, priority) without the rule's cookie is left alone.
        NotFound only when ingress_port is not a managed port name.
        """
        if not self.managed(rule.ingress_port):
            raise NotFound(f"{rule.ingress_port!r} is not a managed port")
        cookie = rule_cookie(rule.rule_id)
        with self._kernel(f"removing rule {rule.rule_id!r}"):
            ifindex = self._ifindex(rule.ingress_port)
            if ifindex is not None and 1 <= rule.priority <= 0xFFFF:
                self._delete_ours(ifindex, rule.priority, cookie)
            self._rule_ids.pop(cookie, None)

    def counters(self, rule: FlowRule) -> RuleCounters:
        """Packets and bytes the rule's first action saw, when, and whether in hardware."""
        cookie = rule_cookie(rule.rule_id)
        with self._kernel(f"reading the counters of rule {rule.rule_id!r}"):
            ifindex = self._managed_ifindex(rule.ingress_port)
            found = [f for f in self._filters(ifindex, rule.priority) if f.cookie == cookie]
            now_ns = time.time_ns()
        if not found:
            raise NotFound(
                f"rule {rule.rule_id!r} is not installed on {rule.ingress_port}"
                f" at priority {rule.priority}"
            )
        f = found[0]
        last_used_ns = 0
        if f.packets and f.lastuse is not None:
            last_used_ns = now_ns - f.lastuse * 1_000_000_000 // _USER_HZ
        return RuleCounters(
            packets=f.packets,
            bytes=f.bytes,
            last_used_ns=last_used_ns,
            in_hardware=bool(f.flags & TCA_CLS_FLAGS_IN_HW),
        )

    def installed(self) -> list[InstalledRule]:
        """Every filter on the ingress of managed ports, any classifier, any chain.

        `rule_id` is the id for our cookies (the `"cookie:<hex>"` string for ones
        this object has not installed or been told about), None for other filters.
        """
        rules = []
        with self._kernel("listing filters"):
            for name, ifindex in self._links():
                if not self.managed(name):
                    continue
                rules += [
                    InstalledRule(ingress_port=name, priority=f.pref, rule_id=self._rule_id(f))
                    for f in self._filters(ifindex)
                ]
        return sorted(rules, key=lambda r: (r.ingress_port, r.priority, r.rule_id or ""))

    def close(self) -> None:
        """Close the rtnetlink socket."""
        with self._lock:
            self._rtnl.close()

    # Helpers below run with the lock held.
    @contextlib.contextmanager
    def _kernel(self, what: str) -> Iterator[None]:
        """Hold the lock; a kernel error not handled inside becomes a domain error."""
        with self._lock:
            try:
                yield
            except _KernelError as exc:
                if exc.code == errno.ENODEV:
                    raise NotFound(f"{what}: the port is gone ({exc})") from exc
                raise FailedPrecondition(f"{what}: the kernel refused: {exc}") from exc

    def _rule_id(self, f: _Filter) -> str | None:
        if f.cookie is None or len(f.cookie) != 16 or not f.cookie.startswith(COOKIE_MAGIC):
            return None
        return self._rule_ids.get(f.cookie, COOKIE_PREFIX + f.cookie.hex())

    def _ifindex(self, name: str) -> int | None:
        if not name or len(name.encode()) >= IFNAMSIZ or "/" in name:
            return None
        body = _IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
        body += _string(IFLA_IFNAME, name) + _u32(IFLA_EXT_MASK, RTEXT_FILTER_SKIP_STATS)
        try:
            answers = self._rtnl.request(RTM_GETLINK, NLM_F_REQUEST, body)
        except _KernelError as exc:
            if exc.code in (errno.ENODEV, errno.ENOENT, errno.EINVAL):
                return None
            raise Unavailable(f"cannot look up port {name!r}: {exc}") from exc
        if not answers:
            return None
        return int(_IFINFOMSG.unpack_from(answers[0], _NLMSGHDR.size)[2])

    def _managed_ifindex(self, name: str) -> int:
        if not self.managed(name):
            raise NotFound(f"{name!r} is not a managed port")
        ifindex = self._ifindex(name)
        if ifindex is None:
            raise NotFound(f"no port named {name!r}")
        return ifindex

    def _target_ifindex(self, name: str) -> int:
        ifindex = self._ifindex(name)
        if ifindex is None:
            raise NotFound(f"no port named {name!r} to forward or mirror to")
        return ifindex

    def _links(self) -> list[tuple[str, int]]:
        body = _IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
        body += _u32(IFLA_EXT_MASK, RTEXT_FILTER_SKIP_STATS)
        links = []
        for message in self._rtnl.dump(RTM_GETLINK, body):
            if _NLMSGHDR.unpack_from(message)[1] != RTM_NEWLINK:
                continue
            ifindex = _IFINFOMSG.unpack_from(message, _NLMSGHDR.size)[2]
            name = _attrs(message, _NLMSGHDR.size + _IFINFOMSG.size).get(IFLA_IFNAME)
            if name:
                links.append((_asciiz(name), ifindex))
        return links

    def _filters(self, ifindex: int, pref: int = 0) -> list[_Filter]:
        """Filters on the ingress hook (at one priority when pref > 0), any chain."""
        body = _tcmsg(ifindex, 0, INGRESS_PARENT, _info(pref))
        filters = (_parse_filter(m) for m in self._rtnl.dump(RTM_GETTFILTER, body))
        return [f for f in filters if f is not None]

    def _ensure_clsact(self, ifindex: int) -> None:
        body = _tcmsg(ifindex, CLSACT_HANDLE, TC_H_CLSACT, 0) + _string(TCA_KIND, "clsact")
        try:
            self._rtnl.request(
                RTM_NEWQDISC, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL, body
            )
        except _KernelError as exc:
            if exc.code != errno.EEXIST:  # a clsact or ingress qdisc: use it
                raise

    def _delete_ours(self, ifindex: int, pref: int, cookie: bytes) -> None:
        for f in self._filters(ifindex, pref):
            if f.cookie != cookie:
                continue
            body = _tcmsg(ifindex, f.handle, INGRESS_PARENT, _info(f.pref, f.protocol))
            body += _string(TCA_KIND, f.kind)
            if f.chain:
                body += _u32(TCA_CHAIN, f.chain)
            try:
                self._rtnl.request(RTM_DELTFILTER, NLM_F_REQUEST | NLM_F_ACK, body)
            except _KernelError as exc:
                if exc.code not in (errno.ENOENT, errno.ENODEV):
                    raise

"""Netlink messages as bytes: the kernel ABI constants, headers and attribute codec.

No sockets and no tc knowledge here (see `rtnl` for the socket, `flower` for the
classifier). Everything is pure, so the encoders are tested without a kernel. The
names follow the kernel headers (linux/netlink.h, rtnetlink.h, if_link.h,
pkt_sched.h) so that the code reads against them.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Final

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
NLMSGHDR: Final = struct.Struct("=IHHII")  # len, type, flags, seq, pid
IFINFOMSG: Final = struct.Struct("=BxHiII")  # family, type, index, flags, change
TCMSG: Final = struct.Struct("=BxxxiIII")  # family, ifindex, handle, parent, info
NLMSGERR: Final = struct.Struct("=i")  # error (negative errno; 0 = an ack), then the request
U32_MAX: Final = 0xFFFFFFFF


NLATTR: Final = struct.Struct("=HH")  # len, type
_PADDING: Final = (b"", b"\0\0\0", b"\0\0", b"\0")  # by length % 4


def attr(kind: int, payload: bytes) -> bytes:
    """One attribute (type, payload), padded to 4 bytes."""
    length = 4 + len(payload)
    return NLATTR.pack(length, kind) + payload + _PADDING[length % 4]


def nest(kind: int, *children: bytes) -> bytes:
    """A nested attribute holding `children`."""
    return attr(kind | NLA_F_NESTED, b"".join(children))


def u8(kind: int, value: int) -> bytes:
    """A u8 attribute."""
    return attr(kind, struct.pack("=B", value))


def u16(kind: int, value: int) -> bytes:
    """A u16 attribute (host order)."""
    return attr(kind, struct.pack("=H", value))


def be16(kind: int, value: int) -> bytes:
    """A big-endian u16 attribute."""
    return attr(kind, struct.pack("!H", value))


def u32(kind: int, value: int) -> bytes:
    """A u32 attribute (host order)."""
    return attr(kind, struct.pack("=I", value))


def be32(kind: int, value: int) -> bytes:
    """A big-endian u32 attribute."""
    return attr(kind, struct.pack("!I", value))


def string(kind: int, value: str) -> bytes:
    """A NUL-terminated string attribute."""
    return attr(kind, value.encode() + b"\0")


def parse_attrs(data: bytes, offset: int = 0) -> dict[int, bytes]:
    """Attributes from `offset` to the end, by type (flags masked; last one wins)."""
    found: dict[int, bytes] = {}
    end = len(data)
    while offset + 4 <= end:
        length, kind = NLATTR.unpack_from(data, offset)
        if length < 4:
            break
        found[kind & NLA_TYPE_MASK] = data[offset + 4 : offset + length]
        offset += (length + 3) & ~3
    return found


def asciiz(value: bytes) -> str:
    """The string before the first NUL of an attribute."""
    return value.split(b"\0", 1)[0].decode(errors="replace")


class KernelError(Exception):
    """The kernel answered a request with an error."""

    def __init__(self, code: int, message: str) -> None:
        self.code = code
        self.message = message
        reason = os.strerror(code)
        super().__init__(f"{reason}: {message}" if message else reason)


def extack(payload: bytes, flags: int) -> str:
    """The kernel's message in an NLMSG_ERROR payload (error, request, attributes)."""
    if not flags & NLM_F_ACK_TLVS or len(payload) < 20:
        return ""
    echoed = 16 if flags & NLM_F_CAPPED else struct.unpack_from("=I", payload, 4)[0]
    text = parse_attrs(payload, 4 + ((echoed + 3) & ~3)).get(NLMSGERR_ATTR_MSG)
    return asciiz(text) if text else ""


def message(msg_type: int, flags: int, seq: int, body: bytes) -> bytes:
    """One netlink message: the header (port id 0: to the kernel) and `body`."""
    return NLMSGHDR.pack(NLMSGHDR.size + len(body), msg_type, flags, seq, 0) + body


def messages(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """(type, flags, seq, whole message) of every message in a datagram."""
    found = []
    offset = 0
    while offset + NLMSGHDR.size <= len(data):
        length, kind, flags, seq, _ = NLMSGHDR.unpack_from(data, offset)
        found.append((kind, flags, seq, data[offset : offset + length]))
        offset += max((length + 3) & ~3, NLMSGHDR.size)
    return found


def error_code(msg: bytes) -> int:
    """The errno (positive; 0 = success) of an NLMSG_ERROR or NLMSG_DONE message."""
    if len(msg) < NLMSGHDR.size + NLMSGERR.size:
        return 0
    code: int = -NLMSGERR.unpack_from(msg, NLMSGHDR.size)[0]
    return code


def tcmsg(ifindex: int, handle: int, parent: int, info: int) -> bytes:
    """A struct tcmsg (family AF_UNSPEC)."""
    return TCMSG.pack(socket.AF_UNSPEC, ifindex, handle, parent, info)


def tc_info(pref: int, protocol: int = 0) -> int:
    """tcm_info of a filter: priority (pref) and protocol (host order in, network out)."""
    return (pref << 16) | socket.htons(protocol)

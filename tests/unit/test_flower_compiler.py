"""The rule -> flower compiler and the netlink codec, without a kernel.

tests/vm/network checks the same filters against the kernel; these pin the bytes.
"""

import ipaddress
import socket
import struct

import pytest

from dpu_agent.errors import InvalidArgument
from dpu_agent.network import flower
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
    VlanPush,
    VxlanEncap,
)
from dpu_agent.network.validate import LIMITS, check_rule

IFINDEX = {"rep1": 11, "rep2": 12, "rep3": 13}
net = ipaddress.ip_network


def rule(match=FlowMatch(), actions=(Forward("rep2"),), **kw):  # noqa: B008 - frozen
    return FlowRule(kw.pop("rid", "r1"), kw.pop("priority", 7), "rep1", match, actions, **kw)


def options(compiled: flower.CompiledFilter) -> dict[int, bytes]:
    return nl.parse_attrs(compiled.options)


def actions(compiled: flower.CompiledFilter) -> list[dict[int, bytes]]:
    nested = nl.parse_attrs(options(compiled)[flower.TCA_FLOWER_ACT])
    return [nl.parse_attrs(nested[prio]) for prio in sorted(nested)]


def be16(data: bytes) -> int:
    value: int = struct.unpack("!H", data)[0]
    return value


def test_attributes_are_padded_nested_and_parsed_back():
    one = nl.attr(5, b"abc")
    assert one == struct.pack("=HH", 7, 5) + b"abc\0"
    nested = nl.nest(9, nl.u32(1, 0xDEADBEEF), nl.string(2, "flower"))
    assert struct.unpack_from("=H", nested, 2)[0] == 9 | nl.NLA_F_NESTED
    inner = nl.parse_attrs(nl.parse_attrs(nested)[9])
    assert struct.unpack("=I", inner[1])[0] == 0xDEADBEEF
    assert nl.asciiz(inner[2]) == "flower"


def test_a_datagram_splits_into_its_messages_and_errors_carry_the_reason():
    reason = nl.attr(nl.NLMSGERR_ATTR_MSG, b"Not supported\0")
    echoed = nl.NLMSGHDR.pack(16, nl.RTM_NEWTFILTER, 0, 7, 0)
    error = nl.message(nl.NLMSG_ERROR, nl.NLM_F_ACK_TLVS | nl.NLM_F_CAPPED, 7, b"")
    error = error[:16] + struct.pack("=i", -95) + echoed + reason
    error = struct.pack("=I", len(error)) + error[4:]
    ack = nl.message(nl.NLMSG_ERROR, 0, 8, struct.pack("=i", 0) + echoed)
    found = nl.messages(error + ack)
    assert [(kind, seq) for kind, _, seq, _ in found] == [(nl.NLMSG_ERROR, 7), (nl.NLMSG_ERROR, 8)]
    assert nl.error_code(found[0][3]) == 95
    assert nl.extack(found[0][3][16:], found[0][1]) == "Not supported"
    assert nl.error_code(found[1][3]) == 0


def test_a_match_all_forward_is_protocol_all_with_a_redirect_and_the_cookie():
    compiled = flower.compile_rule(rule(), IFINDEX)
    assert (compiled.pref, compiled.protocol, compiled.chain) == (7, flower.ETH_P_ALL, 0)
    opts = options(compiled)
    assert struct.unpack("=I", opts[flower.TCA_FLOWER_FLAGS])[0] == 0
    assert flower.TCA_FLOWER_KEY_ETH_TYPE not in opts
    (only,) = actions(compiled)
    assert nl.asciiz(only[flower.TCA_ACT_KIND]) == "mirred"
    assert only[flower.TCA_ACT_COOKIE] == flower.rule_cookie("r1")
    parms = nl.parse_attrs(only[flower.TCA_ACT_OPTIONS])[flower.TCA_ACT_PARMS]
    verdict = flower.TC_GEN.unpack_from(parms)[2]
    eaction, ifindex = struct.unpack_from("=iI", parms, flower.TC_GEN.size)
    assert (verdict, eaction, ifindex) == (flower.TC_ACT_STOLEN, flower.TCA_EGRESS_REDIR, 12)


def test_keys_follow_the_match():
    match = FlowMatch(
        vlan_id=10,
        ip_protocol=17,
        dst_ip=net("2001:db8::/64"),
        dst_port=53,
        dst_mac="02:00:00:00:00:AA",
        vxlan_vni=42,
    )
    compiled = flower.compile_rule(rule(match=match, actions=(Drop(),)), IFINDEX)
    opts = options(compiled)
    assert compiled.protocol == flower.ETH_P_8021Q
    assert be16(opts[flower.TCA_FLOWER_KEY_ETH_TYPE]) == flower.ETH_P_8021Q
    assert struct.unpack("=H", opts[flower.TCA_FLOWER_KEY_VLAN_ID])[0] == 10
    assert be16(opts[flower.TCA_FLOWER_KEY_VLAN_ETH_TYPE]) == flower.ETH_P_IPV6
    assert opts[flower.TCA_FLOWER_KEY_IP_PROTO] == b"\x11"
    assert opts[flower.TCA_FLOWER_KEY_IPV6_DST] == net("2001:db8::/64").network_address.packed
    assert opts[flower.TCA_FLOWER_KEY_IPV6_DST + 1] == net("2001:db8::/64").netmask.packed
    assert be16(opts[flower.TCA_FLOWER_KEY_UDP_DST]) == 53
    assert opts[flower.TCA_FLOWER_KEY_ETH_DST] == bytes.fromhex("0200000000aa")
    assert struct.unpack("!I", opts[flower.TCA_FLOWER_KEY_ENC_KEY_ID])[0] == 42


@pytest.mark.parametrize(("proto", "key"), [(6, "TCP"), (17, "UDP"), (132, "SCTP")])
def test_l4_ports_use_the_protocols_keys(proto, key):
    match = FlowMatch(ethertype=0x0800, ip_protocol=proto, src_port=1, dst_port=2)
    opts = options(flower.compile_rule(rule(match=match), IFINDEX))
    assert be16(opts[getattr(flower, f"TCA_FLOWER_KEY_{key}_SRC")]) == 1
    assert be16(opts[getattr(flower, f"TCA_FLOWER_KEY_{key}_DST")]) == 2


@pytest.mark.parametrize(
    ("policy", "default", "flags"),
    [
        (OffloadPolicy.ANY, OffloadPolicy.ANY, 0),
        (OffloadPolicy.ANY, OffloadPolicy.SOFTWARE_ONLY, flower.TCA_CLS_FLAGS_SKIP_HW),
        (OffloadPolicy.HARDWARE_ONLY, OffloadPolicy.SOFTWARE_ONLY, flower.TCA_CLS_FLAGS_SKIP_SW),
    ],
)
def test_offload_policy_becomes_skip_flags(policy, default, flags):
    compiled = flower.compile_rule(rule(offload=policy), IFINDEX, default)
    assert struct.unpack("=I", options(compiled)[flower.TCA_FLOWER_FLAGS])[0] == flags


def test_every_action_is_encoded_in_order_and_only_the_last_ends_the_chain():
    tunnel = VxlanEncap(5, ipaddress.ip_address("10.0.0.1"), ipaddress.ip_address("10.0.0.2"))
    compiled = flower.compile_rule(
        rule(
            actions=(
                Count(),
                Police(8_000_000, 10_000),
                VlanPush(100, 3),
                Mirror("rep3"),
                tunnel,
                Forward("rep2"),
            )
        ),
        IFINDEX,
    )
    encoded = actions(compiled)
    kinds = [nl.asciiz(a[flower.TCA_ACT_KIND]) for a in encoded]
    assert kinds == ["gact", "police", "vlan", "mirred", "tunnel_key", "mirred"]
    assert [flower.TCA_ACT_COOKIE in a for a in encoded] == [True] + [False] * 5
    gact = nl.parse_attrs(encoded[0][flower.TCA_ACT_OPTIONS])[flower.TCA_ACT_PARMS]
    assert flower.TC_GEN.unpack_from(gact)[2] == flower.TC_ACT_PIPE
    police = nl.parse_attrs(encoded[1][flower.TCA_ACT_OPTIONS])
    assert struct.unpack("=I", police[flower.TCA_POLICE_RESULT])[0] == flower.TC_ACT_PIPE
    assert len(police[flower.TCA_POLICE_RATE]) == 1024


def test_the_filter_request_and_a_dumped_filter_read_back():
    compiled = flower.compile_rule(rule(match=FlowMatch(dst_ip=net("10.1.0.0/16"))), IFINDEX)
    body = compiled.new_request(11)
    family, ifindex, handle, parent, info = nl.TCMSG.unpack_from(body)
    # the handle is the rule's priority, the pref (until the layout groups it) too
    assert (family, ifindex, handle, parent) == (socket.AF_UNSPEC, 11, 7, nl.INGRESS_PARENT)
    assert info == nl.tc_info(7, flower.ETH_P_IP)
    dumped = nl.message(nl.RTM_NEWTFILTER, 0, 1, nl.tcmsg(11, 1, nl.INGRESS_PARENT, info))
    dumped += body[nl.TCMSG.size :]
    dumped = struct.pack("=I", len(dumped)) + dumped[4:]
    found = flower.parse_filter(dumped)
    assert found is not None
    assert (found.handle, found.pref, found.protocol, found.kind) == (1, 7, 0x0800, "flower")
    assert found.cookie == flower.rule_cookie("r1")
    assert found.packets == 0
    assert flower.delete_request(11, found)[: nl.TCMSG.size] == nl.tcmsg(
        11, 1, nl.INGRESS_PARENT, info
    )


@pytest.mark.parametrize(
    "bad",
    [
        rule(match=FlowMatch(vlan_id=4095)),
        rule(match=FlowMatch(ip_protocol=6)),
        rule(match=FlowMatch(ethertype=0x0800, dst_port=80)),
        rule(match=FlowMatch(vlan_id=5, ethertype=0x8100)),
        rule(actions=(Drop(), Count())),
        rule(actions=(Forward("rep2"), Count())),
        rule(actions=(VlanPush(4095),)),
        rule(actions=(Count(),) * (LIMITS["actions"][1] + 1)),
        rule(priority=0),
    ],
)
def test_the_compiler_refuses_what_the_service_refuses(bad):
    with pytest.raises(InvalidArgument) as by_compiler:
        flower.compile_rule(bad, IFINDEX)
    with pytest.raises(InvalidArgument) as by_service:
        check_rule(bad, set(IFINDEX))
    assert str(by_compiler.value) == str(by_service.value)


def test_a_burst_too_long_for_tc_is_refused():
    with pytest.raises(InvalidArgument, match="lasts too long"):
        flower.compile_rule(rule(actions=(Police(8, (1 << 32) - 1),)), IFINDEX)


def test_rules_share_a_mask_group_when_only_their_key_values_differ():
    def group(match: FlowMatch, offload: OffloadPolicy = OffloadPolicy.ANY) -> tuple[object, ...]:
        return flower.compile_rule(rule(match=match, offload=offload), IFINDEX).group

    a = group(FlowMatch(dst_ip=net("10.1.0.1/32")))
    assert a == group(FlowMatch(dst_ip=net("10.9.9.9/32")))
    assert a != group(FlowMatch(dst_ip=net("10.1.0.0/24")))  # another mask
    assert a != group(FlowMatch(src_ip=net("10.1.0.1/32")))  # another key
    assert a != group(FlowMatch(dst_ip=net("2001:db8::1/128")))  # another protocol
    assert a != group(FlowMatch(dst_ip=net("10.1.0.1/32")), OffloadPolicy.SOFTWARE_ONLY)
    udp = group(FlowMatch(ethertype=0x0800, ip_protocol=17, dst_port=53))
    assert udp == group(FlowMatch(ethertype=0x0800, ip_protocol=17, dst_port=54))
    assert udp != group(
        FlowMatch(ethertype=0x0800, ip_protocol=6, dst_port=53)
    )  # tcp ports: other keys
    assert udp != group(FlowMatch(ethertype=0x0800, ip_protocol=17))


@pytest.mark.parametrize(
    "actions",
    [
        (Forward("rep2"),),
        (Drop(),),
        (Count(), Police(rate_bps=8_000_000, burst_bytes=10_000), Forward("rep2")),
        (VlanPush(vlan_id=7), Mirror("rep2"), Forward("rep2")),
    ],
)
def test_actions_encoded_from_a_shared_template_are_byte_for_byte_the_same(actions):
    for cookie in (flower.rule_cookie("a"), flower.rule_cookie("b"), bytes(16)):
        assert flower.encode_actions(actions, IFINDEX, cookie) == flower._actions(
            actions, IFINDEX, cookie
        )


@pytest.mark.parametrize(
    "match",
    [
        FlowMatch(),
        FlowMatch(dst_ip=net("10.1.0.0/24")),
        FlowMatch(src_ip=net("2001:db8::/48"), dst_ip=net("2001:db8:1::/64"), ip_protocol=6),
        FlowMatch(
            vlan_id=10,
            ethertype=0x0800,
            src_mac="02:00:00:00:00:01",
            dst_mac="02:00:00:00:00:02",
            ip_protocol=17,
            src_port=1,
            dst_port=2,
            vxlan_vni=7,
        ),
    ],
)
def test_the_mask_is_the_keys_present_with_the_mask_attributes_values(match):
    _, keys, mask = flower.flower_match(match)
    read_back = nl.parse_attrs(keys)
    assert sorted(kind for kind, _ in mask) == sorted(read_back)
    assert len(mask) == len(read_back)
    for kind, value in mask:
        assert value == (read_back[kind] if kind in flower.MASK_KEYS else b"")

"""`dpuctl port ...` and `dpuctl flow ...`: the DPU's ports and flow rules."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Final

from google.protobuf import json_format

from dpu_wire.v1 import network_pb2

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from host_client._client import Client


def _ip_proto(value: str) -> int:
    return {"tcp": 6, "udp": 17, "icmp": 1}.get(value) or int(value)


def _int(value: str) -> int:
    return int(value, 0)


MATCH_KEYS: Final[dict[str, tuple[str, Callable[[str], object]]]] = {
    "ethertype": ("ethertype", _int),
    "src_mac": ("src_mac", str),
    "dst_mac": ("dst_mac", str),
    "vlan": ("vlan_id", int),
    "ip_proto": ("ip_protocol", _ip_proto),
    "src_ip": ("src_ip_prefix", str),
    "dst_ip": ("dst_ip_prefix", str),
    "src_port": ("src_l4_port", int),
    "dst_port": ("dst_l4_port", int),
    "vni": ("vxlan_vni", int),
}
OFFLOAD: Final = {
    "any": network_pb2.OFFLOAD_POLICY_ANY,
    "hardware": network_pb2.OFFLOAD_POLICY_HARDWARE_ONLY,
    "software": network_pb2.OFFLOAD_POLICY_SOFTWARE_ONLY,
}


def _port(name: str) -> str:
    return name if name.startswith("ports/") else f"ports/{name}"


def _rule_name(name: str) -> str:
    return name if name.startswith("flowRules/") else f"flowRules/{name}"


def match_arg(text: str) -> tuple[str, object]:
    """KEY=VALUE for --match."""
    key, sep, value = text.partition("=")
    if not sep or key not in MATCH_KEYS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected KEY=VALUE, KEY one of {', '.join(MATCH_KEYS)}"
        )
    field, parse = MATCH_KEYS[key]
    try:
        return field, parse(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: bad value for {key}") from None


def action_arg(text: str) -> network_pb2.FlowAction:  # noqa: PLR0911
    """An --action value.

    One of forward=PORT, mirror=PORT, drop, count, police=RATE_BPS[/BURST],
    vlan_push=ID[/PRIO], vlan_pop, vxlan_decap.
    """
    kind, _, value = text.partition("=")
    try:
        if kind == "forward" and value:
            return network_pb2.FlowAction(forward=network_pb2.ForwardAction(port=_port(value)))
        if kind == "mirror" and value:
            return network_pb2.FlowAction(mirror=network_pb2.MirrorAction(port=_port(value)))
        if kind == "drop":
            return network_pb2.FlowAction(drop=network_pb2.DropAction())
        if kind == "count":
            return network_pb2.FlowAction(count=network_pb2.CountAction())
        if kind == "police" and value:
            rate, _, burst = value.partition("/")
            police = network_pb2.PoliceAction(rate_bps=int(rate), burst_bytes=int(burst or 16384))
            return network_pb2.FlowAction(police=police)
        if kind == "vlan_push" and value:
            vid, _, prio = value.partition("/")
            push = network_pb2.VlanPushAction(vlan_id=int(vid), priority=int(prio or 0))
            return network_pb2.FlowAction(vlan_push=push)
        if kind == "vlan_pop":
            return network_pb2.FlowAction(vlan_pop=network_pb2.VlanPopAction())
        if kind == "vxlan_decap":
            return network_pb2.FlowAction(vxlan_decap=network_pb2.VxlanDecapAction())
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(
        f"{text!r}: expected forward=PORT, mirror=PORT, drop, count, police=BPS[/BURST], "
        "vlan_push=ID[/PRIO], vlan_pop or vxlan_decap"
    )


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The `port` and `flow` commands."""
    port = sub.add_parser("port", help="the DPU's ports")
    port.add_subparsers(dest="action", required=True, metavar="ACTION").add_parser(
        "list", help="ports with kind, state, MAC, MTU and counters"
    )
    flow = sub.add_parser("flow", help="flow rules (tc flower on the DPU's ports)")
    act = flow.add_subparsers(dest="action", required=True, metavar="ACTION")
    add = act.add_parser("add", help="add a rule")
    add.add_argument("id", help="rule id (its name is flowRules/{id})")
    add.add_argument("--port", required=True, help="ingress port")
    add.add_argument("--priority", type=int, required=True, help="1..65535, lower first")
    add.add_argument("--match", type=match_arg, action="append", default=[], metavar="KEY=VALUE")
    add.add_argument("--action", type=action_arg, action="append", required=True, dest="actions")
    add.add_argument("--offload", choices=OFFLOAD, default="any")
    listing = act.add_parser("list", help="rules, optionally on one port")
    listing.add_argument("--port", default="")
    for name, text in (("del", "remove a rule"), ("stats", "a rule's packets, bytes, last use")):
        cmd = act.add_parser(name, help=text)
        cmd.add_argument("id")


def _rule_line(r: network_pb2.FlowRule) -> str:
    actions = ",".join(a.WhichOneof("action") or "?" for a in r.actions)
    match = json_format.MessageToDict(r.match, preserving_proto_field_name=True)
    return f"{r.name:<28} {r.ingress_port:<16} prio {r.priority:<6} match {match} -> {actions}"


async def run_port(client: Client, args: argparse.Namespace) -> int:
    """`port list`."""
    ports = await client.list_ports()
    if args.json:
        print(json.dumps([json_format.MessageToDict(p) for p in ports], indent=2))
        return 0
    for p in ports:
        kind = network_pb2.PortKind.Name(p.kind).removeprefix("PORT_KIND_").lower()
        state = network_pb2.OperState.Name(p.oper_state).removeprefix("OPER_STATE_").lower()
        c = p.counters
        print(
            f"{p.name:<20} {kind:<12} {state:<5} {p.mac_address} mtu {p.mtu:<5} "
            f"rx {c.rx_packets} pkts {c.rx_bytes} B  tx {c.tx_packets} pkts {c.tx_bytes} B"
        )
    if not ports:
        print("no ports")
    return 0


async def _add(client: Client, args: argparse.Namespace) -> int:
    match = network_pb2.FlowMatch()
    for field, value in args.match:
        setattr(match, field, value)
    rule = network_pb2.FlowRule(
        priority=args.priority,
        ingress_port=_port(args.port),
        match=match,
        actions=args.actions,
        offload=OFFLOAD[args.offload],
    )
    made = await client.create_flow_rule(args.id, rule)
    print(_rule_line(made))
    return 0


async def _list(client: Client, args: argparse.Namespace) -> int:
    rules = await client.list_flow_rules(_port(args.port) if args.port else "")
    if args.json:
        print(json.dumps([json_format.MessageToDict(r) for r in rules], indent=2))
        return 0
    for r in rules:
        print(_rule_line(r))
    if not rules:
        print("no flow rules")
    return 0


async def _del(client: Client, args: argparse.Namespace) -> int:
    await client.delete_flow_rule(_rule_name(args.id))
    print(f"deleted {_rule_name(args.id)}")
    return 0


async def _stats(client: Client, args: argparse.Namespace) -> int:
    r = await client.get_flow_rule(_rule_name(args.id))
    c = r.counters
    used = c.last_used.ToJsonString() if c.last_used.seconds else "never"
    if args.json:
        print(json_format.MessageToJson(c, preserving_proto_field_name=True))
    else:
        where = "hardware" if r.in_hardware else "software"
        print(f"{r.name}: {c.packets} packets, {c.bytes} bytes, last used {used} ({where})")
    return 0


FLOW_ACTIONS: Final[dict[str, Callable[[Client, argparse.Namespace], Awaitable[int]]]] = {
    "add": _add,
    "list": _list,
    "del": _del,
    "stats": _stats,
}


async def run_flow(client: Client, args: argparse.Namespace) -> int:
    """Dispatch a `flow` action."""
    return await FLOW_ACTIONS[args.action](client, args)

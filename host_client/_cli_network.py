"""`dpuctl port ...` and `dpuctl flow ...`: the DPU's ports and flow rules."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

from google.protobuf import json_format

from dpu_wire.v1 import network_pb2
from host_client._display import enum_name, printable
from host_client._tls import TOKEN_ENV

_M = TypeVar("_M", network_pb2.FlowRule, network_pb2.FlowAction)

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
LOCAL_ADMIN_TENANT: Final = "default"
"""The tenant of a plaintext loopback agent's callers without a token (dpu_agent.auth)."""


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


APPLY_HELP: Final = """\
Compare FILE with your rules on the agent, print what will change (+ create,
~ update, - delete), and apply all of it in one ApplyFlowRules call: every change
takes, or none does. FILE (YAML or JSON):

  rules:
    - name: web-in                  # the rule's id (or flowRules/web-in)
      ingress_port: pf0vf0
      priority: 1000                # 1..999 are the admin role's
      match: {ethertype: 0x0800, ip_protocol: 6, dst_l4_port: 80}
      actions: [count, vlan_push=200, forward=p0]  # --action syntax, or {forward: {port: p0}}
      offload: any                  # any (default), hardware, software
  delete: [old-rule]                # optional: rules to remove

match takes the FlowMatch fields of the API (docs/api.md). A rule whose ingress
port changes is deleted and created. A tenant's rule (not an admin's) takes a
priority of 1000 or more, and sends to an uplink (p0, p1) only in a VLAN its tenant
was granted (vlan_push before the forward, or matched) unless the operator allows
it untagged traffic (README, "Tags in flow rules").

--prune deletes the rules of one tenant only: yours (the CN of your client
certificate; "default" on a plaintext loopback agent without a token), or the
one --tenant names. An admin sees every tenant's rules but prunes only its own
unless --tenant names another. With a bearer token, give --tenant (dpuctl cannot
tell a token's tenant). At most 1024 rules per list. Reading YAML
needs PyYAML (not a dependency of the SDK); JSON needs nothing.
"""


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
    add.add_argument(
        "--priority",
        type=int,
        required=True,
        help="1..65535, lower first; 1..999 are the admin role's (a tenant's rule: 1000 and up)",
    )
    add.add_argument("--match", type=match_arg, action="append", default=[], metavar="KEY=VALUE")
    add.add_argument("--action", type=action_arg, action="append", required=True, dest="actions")
    add.add_argument("--offload", choices=OFFLOAD, default="any")
    apply = act.add_parser(
        "apply",
        help="make the rules in FILE so, as one unit (all or none)",
        description=APPLY_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    apply.add_argument("file", help="a YAML or JSON rule set ('-': standard input)")
    apply.add_argument(
        "--dry-run",
        action="store_true",
        help="print the diff, let the agent check it, change nothing",
    )
    apply.add_argument(
        "--prune",
        action="store_true",
        help="also delete your rules that FILE does not list (your tenant's only, admins too)",
    )
    apply.add_argument(
        "--tenant",
        help="with --prune: whose rules to delete instead of yours (an admin's choice)",
    )
    listing = act.add_parser("list", help="rules, optionally on one port")
    listing.add_argument("--port", default="")
    for name, text in (("del", "remove a rule"), ("stats", "a rule's packets, bytes, last use")):
        cmd = act.add_parser(name, help=text)
        cmd.add_argument("id")


def _rule_line(r: network_pb2.FlowRule) -> str:
    actions = ",".join(a.WhichOneof("action") or "?" for a in r.actions)
    match = json_format.MessageToDict(r.match, preserving_proto_field_name=True)
    return printable(
        f"{r.name:<28} {r.ingress_port:<16} prio {r.priority:<6} match {match} -> {actions}"
    )


async def run_port(client: Client, args: argparse.Namespace) -> int:
    """`port list`."""
    ports = await client.list_ports()
    if args.json:
        print(json.dumps([json_format.MessageToDict(p) for p in ports], indent=2))
        return 0
    for p in ports:
        kind = enum_name(network_pb2.PortKind.Name, p.kind, "PORT_KIND_").lower()
        state = enum_name(network_pb2.OperState.Name, p.oper_state, "OPER_STATE_").lower()
        c = p.counters
        print(
            printable(
                f"{p.name:<20} {kind:<12} {state:<5} {p.mac_address} mtu {p.mtu:<5} "
                f"rx {c.rx_packets} pkts {c.rx_bytes} B  tx {c.tx_packets} pkts {c.tx_bytes} B"
            )
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
    print(printable(f"deleted {_rule_name(args.id)}"))
    return 0


async def _stats(client: Client, args: argparse.Namespace) -> int:
    r = await client.get_flow_rule(_rule_name(args.id))
    c = r.counters
    used = c.last_used.ToJsonString() if c.last_used.seconds else "never"
    if args.json:
        print(json_format.MessageToJson(c, preserving_proto_field_name=True))
    else:
        where = "hardware" if r.in_hardware else "software"
        print(
            printable(f"{r.name}: {c.packets} packets, {c.bytes} bytes, last used {used} ({where})")
        )
    return 0


def _load(path: str) -> object:
    text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        import yaml  # noqa: PLC0415 - only `flow apply` of a YAML file needs it
    except ImportError:
        raise SystemExit(f"{path}: not JSON, and reading YAML needs PyYAML") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SystemExit(f"{path}: {exc}") from None


def _file_action(item: object, where: str) -> network_pb2.FlowAction:
    if isinstance(item, str):
        try:
            return action_arg(item)
        except argparse.ArgumentTypeError as exc:
            raise SystemExit(f"{where}: {exc}") from None
    if not isinstance(item, dict):
        raise SystemExit(f"{where}: an action is a string or a mapping")
    for kind in ("forward", "mirror"):
        if isinstance(item.get(kind), str):
            item = {kind: {"port": item[kind]}}
        if isinstance(item.get(kind), dict) and "port" in item[kind]:
            item = {kind: {**item[kind], "port": _port(str(item[kind]["port"]))}}
    return _parse(item, network_pb2.FlowAction(), where)


def _parse(data: dict[str, Any], message: _M, where: str) -> _M:
    try:
        return json_format.ParseDict(data, message)
    except json_format.ParseError as exc:
        raise SystemExit(f"{where}: {exc}") from None


def rules_from_file(data: object) -> tuple[list[network_pb2.FlowRule], list[str]]:
    """(the rules, the names to delete) of a `flow apply` file's contents."""
    if not isinstance(data, dict) or not isinstance(data.get("rules", []), list):
        raise SystemExit("the file needs a mapping with a list under 'rules'")
    unknown = set(data) - {"rules", "delete"}
    if unknown:
        raise SystemExit(f"the file has unknown keys: {', '.join(sorted(unknown))}")
    rules = []
    for index, raw in enumerate(data.get("rules") or []):
        where = f"rules[{index}]"
        if not isinstance(raw, dict) or not raw.get("name") or not raw.get("ingress_port"):
            raise SystemExit(f"{where}: a rule needs a name and an ingress_port")
        fields = dict(raw)
        actions = fields.pop("actions", None) or []
        offload = fields.pop("offload", "any")
        if not isinstance(actions, list):
            raise SystemExit(f"{where}.actions: a list")
        fields["name"] = _rule_name(str(fields["name"]))
        fields["ingress_port"] = _port(str(fields["ingress_port"]))
        rule = _parse(fields, network_pb2.FlowRule(), where)
        rule.actions.extend(_file_action(a, f"{where}.actions[{i}]") for i, a in enumerate(actions))
        if offload not in OFFLOAD:
            raise SystemExit(f"{where}.offload: one of {', '.join(OFFLOAD)}")
        rule.offload = OFFLOAD[offload]
        rules.append(rule)
    deletes = data.get("delete") or []
    if not isinstance(deletes, list):
        raise SystemExit("delete: a list of rule names")
    return rules, [_rule_name(str(name)) for name in deletes]


def _desired(rule: network_pb2.FlowRule) -> network_pb2.FlowRule:
    """The fields a caller sets (output-only ones cleared), to compare two rules."""
    out = network_pb2.FlowRule()
    out.CopyFrom(rule)
    for field in ("in_hardware", "counters", "tenant", "times"):
        out.ClearField(field)
    out.match.SetInParent()  # an empty match is a match
    if out.offload == network_pb2.OFFLOAD_POLICY_UNSPECIFIED:
        out.offload = network_pb2.OFFLOAD_POLICY_ANY
    return out


def plan(
    current: list[network_pb2.FlowRule],
    rules: list[network_pb2.FlowRule],
    deletes: list[str],
    *,
    prune: str | None,
) -> tuple[list[network_pb2.FlowRule], list[network_pb2.FlowRule], list[str]]:
    """(creates, updates, deletes) that make `current` hold `rules`.

    `prune`: a tenant whose rules in `current` that `rules` does not name are
    deleted too (None: none are). An admin's `current` holds every tenant's rules.
    """
    have = {r.name: _desired(r) for r in current}
    wanted = {r.name for r in rules}
    creates, updates, gone = [], [], []
    for name in deletes:
        if name in wanted:
            raise SystemExit(f"{name} is both listed and to be deleted")
        if name in have:
            gone.append(name)
    for rule in rules:
        old = have.get(rule.name)
        if old is None:
            creates.append(rule)
        elif old.ingress_port != rule.ingress_port:
            gone.append(rule.name)
            creates.append(rule)
        elif old != _desired(rule):
            updates.append(rule)
    if prune is not None:
        gone += sorted(
            r.name
            for r in current
            if r.tenant == prune and r.name not in wanted and r.name not in gone
        )
    return creates, updates, gone


def _prune_tenant(client: Client, args: argparse.Namespace) -> str:
    """The tenant whose rules `flow apply --prune` deletes: --tenant, or the caller's."""
    if args.tenant:
        return str(args.tenant)
    if client.tls is not None:
        tenant = client.tls.tenant()
        if tenant is None:
            raise SystemExit("--prune: no client certificate to tell your tenant; give --tenant")
        return tenant
    if args.token or os.environ.get(TOKEN_ENV):
        raise SystemExit(
            "--prune with a bearer token needs --tenant (dpuctl cannot tell its tenant)"
        )
    return LOCAL_ADMIN_TENANT


async def _apply(client: Client, args: argparse.Namespace) -> int:
    rules, deletes = rules_from_file(_load(args.file))
    names = [r.name for r in rules]
    if len(set(names)) < len(names):
        raise SystemExit("a rule name appears twice in the file")
    prune = _prune_tenant(client, args) if args.prune else None
    current = {r.name: r for r in await client.list_flow_rules()}
    creates, updates, gone = plan(list(current.values()), rules, deletes, prune=prune)
    for rule in creates:
        print(f"+ {_rule_line(rule)}")
    for rule in updates:
        print(f"~ {_rule_line(rule)}")
        print(f"    was {_rule_line(current[rule.name])}")
    for name in gone:
        print(f"- {_rule_line(current[name])}")
    summary = f"{len(creates)} to create, {len(updates)} to update, {len(gone)} to delete"
    if not (creates or updates or gone):
        print("nothing to change")
        return 0
    await client.apply_flow_rules(creates, updates, gone, validate_only=args.dry_run)
    print(f"dry run, checked by the agent: {summary}" if args.dry_run else f"applied: {summary}")
    return 0


FLOW_ACTIONS: Final[dict[str, Callable[[Client, argparse.Namespace], Awaitable[int]]]] = {
    "add": _add,
    "apply": _apply,
    "list": _list,
    "del": _del,
    "stats": _stats,
}


async def run_flow(client: Client, args: argparse.Namespace) -> int:
    """Dispatch a `flow` action."""
    return await FLOW_ACTIONS[args.action](client, args)

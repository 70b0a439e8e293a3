"""`dpuctl function ...`: functions handed to the host or its guests."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Final

from google.protobuf import json_format

from dpu_wire.v1 import virtualization_pb2
from host_client._display import enum_name, printable

if TYPE_CHECKING:
    import argparse
    from collections.abc import Awaitable, Callable

    from host_client._client import Client

TYPES: Final = {
    "vf": virtualization_pb2.FUNCTION_TYPE_VF,
    "sf": virtualization_pb2.FUNCTION_TYPE_SF,
    "virtio-net": virtualization_pb2.FUNCTION_TYPE_VIRTIO_NET,
    "virtio-blk": virtualization_pb2.FUNCTION_TYPE_VIRTIO_BLK,
    "nvme": virtualization_pb2.FUNCTION_TYPE_NVME,
}
_TYPE_NAMES: Final = {v: k for k, v in TYPES.items()}


def _name(text: str) -> str:
    return text if text.startswith("functions/") else f"functions/{text}"


def _volume(text: str) -> str:
    return text if not text or text.startswith("volumes/") else f"volumes/{text}"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `function add/list/show/set/del`."""
    fn = sub.add_parser("function", help="functions for the host: VFs, SFs, virtio, NVMe")
    act = fn.add_subparsers(dest="action", required=True, metavar="ACTION")
    add = act.add_parser(
        "add",
        help="make a function",
        description="Make a function. Network functions get a representor port that flow "
        "rules act on; block functions (virtio-blk, nvme) expose a volume as a block device.",
    )
    add.add_argument("id", help="function id (the name becomes functions/ID)")
    add.add_argument("--type", required=True, choices=TYPES, help="what the host sees")
    add.add_argument("--volume", default="", help="block functions: the volume to expose")
    _settings(add)
    listing = act.add_parser("list", help="every function with its port and device")
    listing.add_argument("--json", action="store_true", help="print JSON")
    show = act.add_parser("show", help="one function")
    show.add_argument("id")
    show.add_argument("--json", action="store_true", help="print JSON")
    change = act.add_parser("set", help="change MAC, MTU, VLAN, rate limit, trust, spoof check")
    change.add_argument("id")
    _settings(change)
    change.add_argument("--no-vlan", action="store_true", help="remove the VLAN")
    delete = act.add_parser(
        "del", help="remove a function (refused while a flow rule or a mount uses it)"
    )
    delete.add_argument("id")


def _settings(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mac", default=None, help="MAC address (default: the backend picks one)")
    p.add_argument("--mtu", type=int, default=None)
    p.add_argument("--vlan", type=int, default=None, help="VLAN id the DPU tags the traffic with")
    p.add_argument("--rate", type=int, default=None, help="rate limit in bit/s (0 = none)")
    p.add_argument("--trust", choices=("on", "off"), default=None)
    p.add_argument("--spoof-check", choices=("on", "off"), default=None)


def _fill(f: virtualization_pb2.Function, args: argparse.Namespace) -> list[str]:
    """Copy the given settings into `f`; return the proto fields set."""
    fields = []
    if args.mac is not None:
        f.mac_address = args.mac
        fields.append("mac_address")
    if args.mtu is not None:
        f.mtu = args.mtu
        fields.append("mtu")
    if args.vlan is not None:
        f.vlan_id = args.vlan
        fields.append("vlan_id")
    if args.rate is not None:
        f.rate_limit_bps = args.rate
        fields.append("rate_limit_bps")
    if args.trust is not None:
        f.trust = args.trust == "on"
        fields.append("trust")
    if args.spoof_check is not None:
        f.spoof_check = args.spoof_check == "on"
        fields.append("spoof_check")
    return fields


def line(f: virtualization_pb2.Function) -> str:
    """One function on one line: name, type, state, port, device (escaped: `printable`)."""
    kind = _TYPE_NAMES.get(f.type, f"unknown({f.type})")
    state = enum_name(virtualization_pb2.FunctionState.Name, f.state, "FUNCTION_STATE_").lower()
    parts = [f"{f.name:<28}", f"{kind:<10}", f"{state:<8}"]
    parts.append(f"port {f.representor_port or '-':<16}")
    parts.append(f"device {f.host_device or '-'}")
    if f.volume:
        parts.append(f"volume {f.volume}")
    if f.mac_address:
        parts.append(f"mac {f.mac_address}")
    if f.HasField("vlan_id"):
        parts.append(f"vlan {f.vlan_id}")
    if f.rate_limit_bps:
        parts.append(f"rate {f.rate_limit_bps} bit/s")
    return printable(" ".join(parts))


async def _add(client: Client, args: argparse.Namespace) -> int:
    f = virtualization_pb2.Function(type=TYPES[args.type], volume=_volume(args.volume))
    f.spoof_check = True  # the default unless --spoof-check off
    _fill(f, args)
    print(line(await client.create_function(args.id, f)))
    return 0


async def _list(client: Client, args: argparse.Namespace) -> int:
    functions = await client.list_functions()
    if args.json:
        print(json.dumps([json_format.MessageToDict(f) for f in functions], indent=2))
        return 0
    for f in functions:
        print(line(f))
    if not functions:
        print("no functions")
    return 0


async def _show(client: Client, args: argparse.Namespace) -> int:
    f = await client.get_function(_name(args.id))
    print(json_format.MessageToJson(f) if args.json else line(f))
    return 0


async def _set(client: Client, args: argparse.Namespace) -> int:
    f = virtualization_pb2.Function(name=_name(args.id))
    fields = _fill(f, args)
    if args.no_vlan:
        fields.append("vlan_id")  # in the mask, absent in the message: removed
    if not fields:
        raise SystemExit("dpuctl function set: give at least one setting to change")
    print(line(await client.update_function(f, fields)))
    return 0


async def _del(client: Client, args: argparse.Namespace) -> int:
    await client.delete_function(_name(args.id))
    print(printable(f"deleted {_name(args.id)}"))
    return 0


ACTIONS: Final[dict[str, Callable[[Client, argparse.Namespace], Awaitable[int]]]] = {
    "add": _add,
    "list": _list,
    "show": _show,
    "set": _set,
    "del": _del,
}


async def run(client: Client, args: argparse.Namespace) -> int:
    """Dispatch a `function` action."""
    return await ACTIONS[args.action](client, args)

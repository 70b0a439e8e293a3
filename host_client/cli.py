"""`dpuctl`: command-line client of the DPU agent.

Exit status: 0 success; 1 the call failed (the agent's status and message are
printed on stderr); 2 bad usage; 4 `health` answered but not SERVING.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import TYPE_CHECKING, Final

from google.protobuf import json_format

from host_client import __version__ as sdk_version
from host_client._client import TARGET_ENV, Client, default_target
from host_client._errors import DpuError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from dpu_wire.v1 import agent_pb2

EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_NOT_SERVING: Final = 4


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("must be greater than 0")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpuctl",
        description="Command-line client of the DPU offload agent (dpu.v1 API).",
        epilog="exit status: 0 ok, 1 call failed, 2 usage error, 4 health not SERVING",
    )
    parser.add_argument(
        "-t",
        "--target",
        default=None,
        help=f"agent address host:port (default ${TARGET_ENV} or {default_target()})",
    )
    parser.add_argument(
        "--timeout", type=_positive_seconds, default=10.0, help="per-call deadline in seconds"
    )
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.add_argument("--version", action="version", version=f"dpuctl {sdk_version}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("info", help="agent identity, RDMA devices and capabilities")
    health = sub.add_parser("health", help="health of the agent or of one service")
    health.add_argument("--service", default="", help="service name, e.g. dpu.v1.AgentService")
    health.add_argument(
        "--wait",
        type=_positive_seconds,
        metavar="SECONDS",
        help="first wait up to SECONDS for the agent to accept connections",
    )
    return parser


def _print_info(info: agent_pb2.AgentInfo) -> None:
    print(f"agent       {info.name}  (version {info.version}, API {info.api_version})")
    print(f"host        {info.hostname}  {info.machine}  kernel {info.kernel}")
    print(f"platform    {info.platform}")
    print(f"started     {info.start_time.ToJsonString()}")
    if not info.rdma_devices:
        print("rdma        no RDMA devices")
    for dev in info.rdma_devices:
        ports = ", ".join(
            f"port {p.port_num} {p.state} {p.link_layer} mtu {p.active_mtu}" for p in dev.ports
        )
        print(f"rdma        {dev.name}  {ports}")
    print("services")
    for cap in info.capabilities:
        state = "available" if cap.available else f"unavailable: {cap.reason}"
        print(f"  {cap.service:<34} {state}")


async def _info(client: Client, args: argparse.Namespace) -> int:
    info = await client.agent_info()
    if args.json:
        print(json_format.MessageToJson(info, preserving_proto_field_name=True))
    else:
        _print_info(info)
    return 0


async def _health(client: Client, args: argparse.Namespace) -> int:
    if args.wait:
        await client.wait_ready(args.wait)
    status = await client.health(args.service)
    if args.json:
        print(json.dumps({"service": args.service, "status": status}))
    else:
        print(status)
    return 0 if status == "SERVING" else EXIT_NOT_SERVING


COMMANDS: Final[dict[str, Callable[[Client, argparse.Namespace], Awaitable[int]]]] = {
    "info": _info,
    "health": _health,
}


async def _run(args: argparse.Namespace) -> int:
    async with Client(args.target, timeout=args.timeout) as client:
        return await COMMANDS[args.command](client, args)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `dpuctl`."""
    args = _parser().parse_args(argv)
    try:
        return asyncio.run(_run(args))
    except DpuError as exc:
        print(f"dpuctl: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

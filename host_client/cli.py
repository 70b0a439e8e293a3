"""`dpuctl`: command-line client of the DPU agent.

Exit status: 0 success; 1 the call failed (the agent's status and message are
printed on stderr); 2 bad usage; 4 `health` answered but not SERVING.

An agent off loopback serves mTLS only: give the CA and this client's certificate
and key (--ca/--cert/--key or $DPU_TLS_CA/$DPU_TLS_CERT/$DPU_TLS_KEY); the
certificate's subject CN is the tenant. `dpuctl certs` makes a lab set.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from typing import TYPE_CHECKING, Final, Literal

from google.protobuf import json_format

from dpu_wire.v1 import agent_pb2, job_pb2, session_pb2
from host_client import __version__ as sdk_version
from host_client import (
    _cli_certs,
    _cli_events,
    _cli_function,
    _cli_network,
    _cli_top,
    _cli_volume,
)
from host_client._client import TARGET_ENV, Client, default_target
from host_client._display import enum_name, printable
from host_client._errors import DpuError, InvalidArgumentError
from host_client._tls import CA_ENV, CERT_ENV, KEY_ENV, SERVER_NAME_ENV, TOKEN_ENV, TlsConfig

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from google.protobuf.message import Message

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
    security = parser.add_argument_group(
        "security",
        "mTLS to the agent (required off loopback), or a bearer token to a plaintext "
        "loopback agent that has a tokens file",
    )
    security.add_argument("--ca", metavar="PEM", help=f"CA of the agent's certificate (${CA_ENV})")
    security.add_argument(
        "--cert", metavar="PEM", help=f"client certificate, CN = tenant (${CERT_ENV})"
    )
    security.add_argument("--key", metavar="PEM", help=f"its private key (${KEY_ENV})")
    security.add_argument(
        "--server-name",
        metavar="NAME",
        help=f"name expected in the agent's certificate (${SERVER_NAME_ENV}; default: target host)",
    )
    security.add_argument(
        "--token", metavar="TOKEN", help=f"bearer token, plaintext loopback only (${TOKEN_ENV})"
    )
    security.add_argument(
        "--plaintext", action="store_true", help="no TLS even if $DPU_TLS_CA is set (loopback)"
    )
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
    session = sub.add_parser("session", help="data-plane sessions on the agent")
    session_sub = session.add_subparsers(dest="action", required=True, metavar="ACTION")
    session_sub.add_parser("list", help="every session: transport, state, jobs, bytes")
    for action, text in (("get", "one session"), ("close", "close a session (cancels its jobs)")):
        cmd = session_sub.add_parser(action, help=text)
        cmd.add_argument("name", help="sessions/{id}")
    _cli_volume.add_parser(sub)
    _cli_events.add_parser(sub)
    _cli_network.add_parser(sub)
    _cli_function.add_parser(sub)
    _cli_certs.add_parser(sub)
    _cli_top.add_parser(sub)
    job = sub.add_parser("job", help="jobs of a session")
    job_sub = job.add_subparsers(dest="action", required=True, metavar="ACTION")
    job_list = job_sub.add_parser("list", help="open and retained jobs of a session")
    job_list.add_argument("session", help="sessions/{id}")
    for action, text in (("get", "one job"), ("cancel", "ask the agent to cancel a job")):
        cmd = job_sub.add_parser(action, help=text)
        cmd.add_argument("name", help="sessions/{id}/jobs/{n}")
    return parser


def _print_json(message: Message) -> None:
    print(json_format.MessageToJson(message, preserving_proto_field_name=True))


def _session_line(s: session_pb2.Session) -> str:
    c = s.counters
    state = enum_name(session_pb2.SessionState.Name, s.state, "SESSION_STATE_")
    kind = enum_name(agent_pb2.Transport.Name, s.transport, "TRANSPORT_").lower()
    return printable(
        f"{s.name:<24} {kind:<6} {state:<8} depth {s.queue_depth:<4} "
        f"jobs {c.jobs_completed}/{c.jobs_submitted} ok, {c.jobs_failed} failed  "
        f"read {c.bytes_read} B  written {c.bytes_written} B  {s.client_label}"
    )


def _job_line(j: job_pb2.Job) -> str:
    state = enum_name(job_pb2.JobState.Name, j.state, "JOB_STATE_")
    line = f"{j.name:<40} {state:<10}"
    if j.HasField("completion"):
        c = j.completion
        line += f" status {c.status.code} read {c.bytes_read} written {c.bytes_written}"
        if c.HasField("crc32c"):
            line += f" crc32c {c.crc32c:#010x}"
        if c.status.message:
            line += f"  ({c.status.message})"
    return printable(line)


async def _session(client: Client, args: argparse.Namespace) -> int:
    if args.action == "list":
        sessions = await client.list_sessions()
        if args.json:
            print(json.dumps([json_format.MessageToDict(s) for s in sessions], indent=2))
        else:
            for s in sessions:
                print(_session_line(s))
            if not sessions:
                print("no sessions")
    elif args.action == "get":
        s = await client.get_session(args.name)
        _print_json(s) if args.json else print(_session_line(s))
    else:
        await client.close_session(args.name)
        print(printable(f"closed {args.name}"))
    return 0


async def _job(client: Client, args: argparse.Namespace) -> int:
    if args.action == "list":
        jobs = await client.list_jobs(args.session)
        if args.json:
            print(json.dumps([json_format.MessageToDict(j) for j in jobs], indent=2))
        else:
            for j in jobs:
                print(_job_line(j))
            if not jobs:
                print("no jobs")
        return 0
    j = await (client.get_job(args.name) if args.action == "get" else client.cancel_job(args.name))
    _print_json(j) if args.json else print(_job_line(j))
    return 0


def _print_info(info: agent_pb2.AgentInfo) -> None:
    lines = [
        f"agent       {info.name}  (version {info.version}, API {info.api_version})",
        f"host        {info.hostname}  {info.machine}  kernel {info.kernel}",
        f"platform    {info.platform}",
        f"started     {info.start_time.ToJsonString()}",
    ]
    if not info.rdma_devices:
        lines.append("rdma        no RDMA devices")
    for dev in info.rdma_devices:
        ports = ", ".join(
            f"port {p.port_num} {p.state} {p.link_layer} mtu {p.active_mtu}" for p in dev.ports
        )
        lines.append(f"rdma        {dev.name}  {ports}")
    lines.append("services")
    for cap in info.capabilities:
        state = "available" if cap.available else f"unavailable: {cap.reason}"
        lines.append(f"  {cap.service:<34} {state}")
    for line in lines:
        print(printable(line))


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
        print(printable(status))
    return 0 if status == "SERVING" else EXIT_NOT_SERVING


COMMANDS: Final[dict[str, Callable[[Client, argparse.Namespace], Awaitable[int]]]] = {
    "info": _info,
    "health": _health,
    "session": _session,
    "job": _job,
    "volume": _cli_volume.run,
    "events": _cli_events.run,
    "port": _cli_network.run_port,
    "flow": _cli_network.run_flow,
    "function": _cli_function.run,
    "top": _cli_top.run,
}


def _tls(args: argparse.Namespace) -> TlsConfig | Literal[False] | None:
    if args.plaintext:
        return False
    if args.ca or args.cert or args.key:
        env = TlsConfig.from_env()
        ca = args.ca or (env.ca if env else None)
        if not ca:
            raise InvalidArgumentError(
                "INVALID_ARGUMENT", "--cert/--key need --ca (or $DPU_TLS_CA)"
            )
        return TlsConfig(
            ca=ca,
            cert=args.cert or (env.cert if env else None),
            key=args.key or (env.key if env else None),
            server_name=args.server_name or (env.server_name if env else None),
        )
    env = TlsConfig.from_env()
    if env is not None and args.server_name:
        return dataclasses.replace(env, server_name=args.server_name)
    return env


async def _run(args: argparse.Namespace) -> int:
    client = Client(args.target, timeout=args.timeout, tls=_tls(args), token=args.token)
    async with client:
        return await COMMANDS[args.command](client, args)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `dpuctl`."""
    args = _parser().parse_args(argv)
    if args.command == "certs":  # local files only: no agent
        return _cli_certs.run(args)
    try:
        return asyncio.run(_run(args))
    except DpuError as exc:
        print(printable(f"dpuctl: {exc}"), file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

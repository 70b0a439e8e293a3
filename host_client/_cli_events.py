"""`dpuctl events`: what the agents publish on the MQTT event broker."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING

from host_client._errors import InvalidArgumentError
from host_client._events import EventSubscriber

if TYPE_CHECKING:
    import argparse

    from host_client._client import Client


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The `events` command."""
    events = sub.add_parser(
        "events",
        help="agent status and job completions from the MQTT broker",
        description="Without --follow: the agents' retained status. With --follow: every job "
        "completion as it is published, until Ctrl-C (or --count events). A broker with "
        "log-ins shows each account what its ACL allows: a tenant sees its own completions.",
    )
    events.add_argument("--broker", default="127.0.0.1:1883", help="MQTT broker host:port")
    events.add_argument("--agent", default="+", help="agent id (default: every agent)")
    events.add_argument("--tenant", default="+", help="tenant id (default: every tenant)")
    events.add_argument("--session", default="+", help="sessions/{id} (default: every session)")
    events.add_argument("--username", help="broker user name (default: anonymous)")
    events.add_argument(
        "--password-file",
        metavar="FILE",
        help="file whose first line is the broker password (never given on the command line)",
    )
    events.add_argument("--ca-file", metavar="PEM", help="CA of the broker's certificate (TLS)")
    events.add_argument("--cert", metavar="PEM", help="client certificate (TLS)")
    events.add_argument("--key", metavar="PEM", help="the client certificate's private key")
    events.add_argument("--follow", action="store_true", help="stream completions")
    events.add_argument("--count", type=int, help="stop after this many completions")


async def run(_client: Client, args: argparse.Namespace) -> int:
    """Print statuses, or follow completions."""
    host, _, port = args.broker.rpartition(":")
    password = _read_password(args.password_file) if args.password_file else None
    subscriber = EventSubscriber(
        host or "127.0.0.1",
        int(port or 1883),
        username=args.username,
        password=password,
        ca_file=args.ca_file,
        cert_file=args.cert,
        key_file=args.key,
    )
    async with subscriber as events:
        if not args.follow:
            async with events.statuses(args.agent) as statuses:
                try:
                    async with asyncio.timeout(1.0):  # retained messages arrive at once
                        async for status in statuses:
                            print(json.dumps({"agent": status.agent_id, "state": status.state}))
                except TimeoutError:
                    pass
            return 0
        seen = 0
        stream = events.completions(agent_id=args.agent, tenant=args.tenant, session=args.session)
        async with stream:
            async for event in stream:
                c = event.completion
                line = {
                    "job": event.job,
                    "state": c.state,
                    "code": c.code,
                    "bytes_read": c.bytes_read,
                    "bytes_written": c.bytes_written,
                }
                if c.crc32c is not None:
                    line["crc32c"] = c.crc32c
                if c.sha256 is not None:
                    line["sha256"] = c.sha256.hex()
                print(json.dumps(line), flush=True)
                seen += 1
                if args.count is not None and seen >= args.count:
                    break
    return 0


def _read_password(path: str) -> str:
    """The first line of the password file."""
    try:
        with Path(path).open(encoding="utf-8") as file:
            return file.readline().rstrip("\r\n")
    except OSError as exc:
        raise InvalidArgumentError(
            "INVALID_ARGUMENT", f"--password-file {path}: {exc.strerror}"
        ) from None

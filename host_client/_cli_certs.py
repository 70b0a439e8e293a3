"""`dpuctl certs ...`: a lab CA, the agent's certificate, tenants' certificates and tokens."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from host_client import _certs

EPILOG = """\
a lab set for an agent on 192.0.2.10 with tenants a and b and an admin:
  dpuctl certs ca pki
  dpuctl certs agent pki --san 192.0.2.10 --san dpu0.lab
  dpuctl certs client pki a ; dpuctl certs client pki b ; dpuctl certs client pki ops --admin
agent:  [tls] cert = "pki/agent.pem"  key = "pki/agent.key"  client_ca = "pki/ca.pem"
client: dpuctl --ca pki/ca.pem --cert pki/client-a.pem --key pki/client-a.key ...
the tenant is the client certificate's subject CN; O=admin gives the admin role.
keys are written 0600; existing files are kept unless --force.
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The `certs` command and its actions."""
    certs = sub.add_parser(
        "certs",
        help="make a lab CA, agent and tenant certificates, bearer tokens (no agent needed)",
        description="Make the files of the agent's mTLS in a directory (a lab PKI).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    act = certs.add_subparsers(dest="action", required=True, metavar="ACTION")
    ca = act.add_parser("ca", help="a new CA: DIR/ca.pem, DIR/ca.key")
    ca.add_argument("dir", type=Path)
    ca.add_argument("--name", default="dpu-offload lab CA", help="the CA's subject CN")
    ca.add_argument("--days", type=int, default=_certs.CA_DAYS)
    agent = act.add_parser("agent", help="the agent's server certificate: DIR/agent.pem, .key")
    agent.add_argument("dir", type=Path, help="directory holding the CA")
    agent.add_argument(
        "--san",
        action="append",
        required=True,
        metavar="NAME",
        help="an IP address or DNS name clients reach the agent at (repeat)",
    )
    agent.add_argument("--days", type=int, default=_certs.LEAF_DAYS)
    client = act.add_parser(
        "client", help="a tenant's client certificate: DIR/client-TENANT.pem, .key"
    )
    client.add_argument("dir", type=Path, help="directory holding the CA")
    client.add_argument("tenant", help="the tenant (subject CN): lowercase letters, digits, -")
    client.add_argument("--admin", action="store_true", help="give the admin role (O=admin)")
    client.add_argument("--days", type=int, default=_certs.LEAF_DAYS)
    token = act.add_parser(
        "token",
        help="a bearer token for a plaintext loopback agent, and its tokens-file entry",
        description="Print a new token on stdout and, on stderr, the [[token]] entry to add "
        "to the agent's [auth] tokens_file (it holds only the token's SHA-256).",
    )
    token.add_argument("tenant")
    token.add_argument("--admin", action="store_true", help="give the admin role")
    for cmd in (ca, agent, client):
        cmd.add_argument("--force", action="store_true", help="replace existing files")


def run(args: argparse.Namespace) -> int:
    """Carry out `dpuctl certs ACTION`."""
    try:
        if args.action == "ca":
            paths = _certs.make_ca(args.dir, name=args.name, days=args.days, force=args.force)
        elif args.action == "agent":
            paths = _certs.make_agent(args.dir, args.san, days=args.days, force=args.force)
        elif args.action == "client":
            paths = _certs.make_client(
                args.dir, args.tenant, admin=args.admin, days=args.days, force=args.force
            )
        else:
            value, entry = _certs.make_token(args.tenant, admin=args.admin)
            print(value)
            print(entry, file=sys.stderr, end="")
            return 0
    except _certs.CertError as exc:
        print(f"dpuctl: {exc}", file=sys.stderr)
        return 1
    for path in paths:
        print(f"wrote {path}")
    return 0

#!/usr/bin/env python3
"""Accounts on the DPU event broker: add, remove and list users of its password file.

    mqtt_users.py add acme > acme.secret                  # a tenant; prints a new password
    mqtt_users.py add acme --password-file - < pw.txt     # ... or takes one (first line)
    mqtt_users.py add dpu-agent --service > agent.secret  # an account the ACL names
    mqtt_users.py remove acme
    mqtt_users.py list

A tenant's user name is its tenant id, so the ACL (deploy/mosquitto/dpu.acl) lets it
read `dpu/v1/agents/+/tenants/<name>/#`: it must be what the agent calls the tenant
(a lowercase DNS label, as every id of the dpu.v1 API). Names that have a `user` block
in the ACL (the agents, the observers) are service accounts: `add` refuses them
without `--service`, so a tenant can never be given an agent's rights by accident.

Passwords are hashed by `mosquitto_passwd` (Debian package mosquitto), fed on its
standard input, never on a command line. The broker re-reads the file on SIGHUP
(`systemctl reload mosquitto`). Needs only the Python standard library.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Final

DEFAULT_USERS_FILE: Final = "/etc/mosquitto/dpu/passwd"  # mosquitto password_file
DEFAULT_ACL: Final = "/etc/mosquitto/dpu/acl"
# The id grammar of the dpu.v1 API (dpu_wire/names.py ID_PATTERN; a test keeps them equal).
NAME_PATTERN: Final = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_NAME_RE: Final = re.compile(NAME_PATTERN)
PASSWORD_BYTES: Final = 24  # 32 URL-safe characters


class UserError(Exception):
    """A request this tool refuses; the message says why."""


def check_name(name: str) -> str:
    """`name` if it can be a user name (and so a topic level), else UserError."""
    if not _NAME_RE.fullmatch(name):
        raise UserError(
            f"user name {name!r} is not a lowercase DNS label "
            "(letters, digits and '-', 1-63 characters, starting and ending with a letter "
            "or digit); a tenant's user name is its tenant id"
        )
    return name


def service_accounts(acl: Path) -> set[str]:
    """The names with a `user` block in the ACL file."""
    try:
        text = acl.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot read the ACL file {acl}: {exc.strerror}") from None
    names = set()
    for line in text.splitlines():
        words = line.split(maxsplit=1)
        if len(words) == 2 and words[0] == "user":
            names.add(words[1].strip())
    return names


def users(passwd: Path) -> list[str]:
    """The user names in a mosquitto password file, in file order."""
    if not passwd.exists():
        return []
    return [
        line.split(":", 1)[0]
        for line in passwd.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]


def _mosquitto_passwd() -> str:
    found = shutil.which("mosquitto_passwd") or (
        "/usr/bin/mosquitto_passwd" if Path("/usr/bin/mosquitto_passwd").exists() else None
    )
    if found is None:
        raise UserError("mosquitto_passwd is not installed (apt-get install mosquitto)")
    return found


def _run(args: list[str], stdin: str = "") -> None:
    proc = subprocess.run(
        [_mosquitto_passwd(), *args], input=stdin, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        # Its prompts go to stdout and never echo the password; its errors to stderr.
        raise UserError(f"mosquitto_passwd failed: {proc.stderr.strip() or proc.returncode}")


def read_password(source: str) -> str:
    """The first line of a file, or of standard input for "-"."""
    if source == "-":
        line = sys.stdin.readline()
    else:
        try:
            with Path(source).open(encoding="utf-8") as file:
                line = file.readline()
        except OSError as exc:
            raise UserError(f"cannot read {source}: {exc.strerror}") from None
    password = line.rstrip("\r\n")
    if not password:
        raise UserError("the password is empty")
    return password


def add(  # noqa: PLR0913 - the command's options
    passwd: Path,
    acl: Path,
    name: str,
    *,
    service: bool = False,
    replace: bool = False,
    password: str | None = None,
) -> str | None:
    """Add (or with `replace`, re-key) a user; return the password if it was generated."""
    check_name(name)
    named = service_accounts(acl)
    if name in named and not service:
        raise UserError(
            f"{name!r} has its own block in {acl} (an agent or observer account): "
            "pass --service to set its password"
        )
    if service and name not in named:
        raise UserError(f"--service: {name!r} has no `user {name}` block in {acl}")
    if name in users(passwd) and not replace:
        raise UserError(f"{name!r} already has a password in {passwd} (--replace to change it)")
    generated = None
    if password is None:
        password = generated = secrets.token_urlsafe(PASSWORD_BYTES)
    if "\n" in password or "\r" in password:
        raise UserError("the password holds a line break")
    if not passwd.exists():
        passwd.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(passwd, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    _run([str(passwd), name], stdin=f"{password}\n{password}\n")
    return generated


def remove(passwd: Path, name: str) -> None:
    """Delete a user from the password file."""
    if name not in users(passwd):
        raise UserError(f"{name!r} is not in {passwd}")
    _run(["-D", str(passwd), name])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Users of the DPU event broker (mosquitto password file); see "
        "deploy/mosquitto/dpu.acl for what each may read and write. Reload the broker "
        "after a change (systemctl reload mosquitto).",
    )
    parser.add_argument("--passwd", default=DEFAULT_USERS_FILE, help="mosquitto password_file")
    parser.add_argument("--acl", default=DEFAULT_ACL, help="mosquitto acl_file")
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser(
        "add",
        help="add a tenant (or --service account); print a new password on stdout",
    )
    cmd.add_argument("name", help="a tenant id, or a name with a `user` block in the ACL")
    cmd.add_argument(
        "--password-file",
        metavar="FILE",
        help="take the password from FILE's first line ('-' = stdin) instead of making one",
    )
    cmd.add_argument("--service", action="store_true", help="an account the ACL names")
    cmd.add_argument("--replace", action="store_true", help="change an existing password")
    cmd = sub.add_parser("remove", help="remove a user")
    cmd.add_argument("name")
    sub.add_parser("list", help="every user, and whether the ACL names it (service) or not")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; exit 0, or 1 with one line on stderr."""
    args = _parser().parse_args(argv)
    passwd, acl = Path(args.passwd), Path(args.acl)
    try:
        if args.command == "add":
            given = None if args.password_file is None else read_password(args.password_file)
            generated = add(
                passwd, acl, args.name, service=args.service, replace=args.replace, password=given
            )
            if generated is not None:
                print(generated)
            print(f"{args.name}: set in {passwd}; reload the broker to apply", file=sys.stderr)
        elif args.command == "remove":
            remove(passwd, args.name)
            print(f"{args.name}: removed from {passwd}; reload the broker", file=sys.stderr)
        else:
            named = service_accounts(acl)
            for name in users(passwd):
                print(f"{name}\t{'service' if name in named else 'tenant'}")
    except UserError as exc:
        print(f"mqtt_users: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

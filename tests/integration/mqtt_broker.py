"""A real mosquitto broker on a free loopback port, for the event-plane tests.

`MosquittoBroker` writes a config into a temporary directory, runs
`mosquitto -c <config>`, waits until the port accepts connections, and stops it
(SIGTERM, wait; SIGKILL if it hangs). `stop()` then `start()` restarts it on the same
port, which is how tests take the broker away and bring it back. With
`persistence=True` the broker saves retained messages, subscriptions and queued
messages on SIGTERM and loads them when it starts again (`kill()` loses them).

With `auth` the broker refuses anonymous clients and takes a password file and an ACL
file (tests/integration/test_mqtt_acl.py uses deploy/mosquitto/dpu.acl itself); with
`tls` it opens a second listener speaking TLS; `config_text` replaces the generated
configuration altogether (its listener must be on HOST:port).

The `mosquitto_broker` fixture (function scope) yields a started broker without
persistence and stops it after the test; it fails the test when mosquitto is not
installed (Debian package `mosquitto`, listed in deploy/apt-packages.txt).
"""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import Iterator

HOST = "127.0.0.1"
START_TIMEOUT = 10.0


def mosquitto_binary() -> str | None:
    """Path of the mosquitto program, or None."""
    found = shutil.which("mosquitto")
    if found:
        return found
    default = Path("/usr/sbin/mosquitto")
    return str(default) if default.exists() else None


@dataclasses.dataclass(frozen=True)
class BrokerAuth:
    """Log-ins required: a mosquitto password file and ACL file (`allow_anonymous false`)."""

    password_file: Path
    acl_file: Path


@dataclasses.dataclass(frozen=True)
class BrokerTls:
    """A second listener on HOST:port speaking TLS with these PEM files.

    With `use_identity_as_username` the client certificate's common name is the user
    name (no password asked); it implies `require_certificate`.
    """

    port: int
    cafile: Path
    certfile: Path
    keyfile: Path
    require_certificate: bool = False
    use_identity_as_username: bool = False

    def config(self) -> list[str]:
        """The listener's configuration lines (they must follow the global ones)."""
        identity = self.use_identity_as_username
        return [
            f"listener {self.port} {HOST}",
            f"cafile {self.cafile}",
            f"certfile {self.certfile}",
            f"keyfile {self.keyfile}",
            f"require_certificate {'true' if self.require_certificate or identity else 'false'}",
            f"use_identity_as_username {'true' if identity else 'false'}",
        ]


def free_port() -> int:
    """A loopback TCP port nobody listens on now."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


class MosquittoBroker:
    """One mosquitto process on HOST:port; start, stop and start again."""

    def __init__(
        self,
        workdir: Path,
        *,
        port: int | None = None,
        persistence: bool = False,
        extra_config: str = "",
        auth: BrokerAuth | None = None,
        tls: BrokerTls | None = None,
        config_text: str | None = None,
    ) -> None:
        binary = mosquitto_binary()
        if binary is None:
            raise FileNotFoundError("mosquitto is not installed (apt-get install mosquitto)")
        self.binary = binary
        self.workdir = workdir
        self.host = HOST
        self.port = port or free_port()
        self.persistence = persistence
        self.extra_config = extra_config
        self.auth = auth
        self.tls = tls
        self.config_text = config_text
        self.config_path = workdir / "mosquitto.conf"
        self.log_path = workdir / "mosquitto.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def config(self) -> str:
        """The broker's configuration text."""
        if self.config_text is not None:
            return self.config_text
        if self.auth is None:
            access = ["allow_anonymous true"]
        else:
            access = [
                "allow_anonymous false",
                f"password_file {self.auth.password_file}",
                f"acl_file {self.auth.acl_file}",
            ]
        lines = [
            f"listener {self.port} {HOST}",
            *access,
            f"persistence {'true' if self.persistence else 'false'}",
            f"persistence_location {self.workdir}/",
            "autosave_interval 0",
            # QoS 1 messages held per client beyond those in flight (default 1000): the
            # tests publish thousands at once to online and offline subscribers.
            "max_queued_messages 1000000",
            # mosquitto started as root would switch to user "mosquitto", which
            # cannot write the persistence file in a private temp directory.
            f"user {getpass.getuser()}",
            "log_dest stderr",
            "log_type error",
            "log_type warning",
            "log_type notice",
            "log_type information",
            "connection_messages true",
            self.extra_config,
            *(self.tls.config() if self.tls is not None else []),
        ]
        return "\n".join(lines) + "\n"

    @property
    def running(self) -> bool:
        """Whether the broker process is alive."""
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = START_TIMEOUT) -> None:
        """Start the broker and wait until it accepts TCP connections."""
        if self.running:
            raise RuntimeError("broker already running")
        self.config_path.write_text(self.config())
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [self.binary, "-c", str(self.config_path)], stdout=log, stderr=log
            )
        self.starts += 1
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"mosquitto exited with {self.proc.returncode}: {self.log_path.read_text()}"
                )
            with contextlib.suppress(OSError), socket.create_connection((HOST, self.port), 0.5):
                return
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"mosquitto did not listen in {timeout} s: {self.log()}")
            time.sleep(0.01)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (persistence is saved) and wait; SIGKILL if it does not exit."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def kill(self) -> None:
        """SIGKILL: connections drop at once, nothing is saved."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        proc.kill()
        proc.wait()

    def log(self) -> str:
        """What the broker logged so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@contextlib.contextmanager
def running_broker(
    workdir: Path,
    *,
    persistence: bool = False,
    auth: BrokerAuth | None = None,
    tls: BrokerTls | None = None,
) -> Iterator[MosquittoBroker]:
    """A started broker, stopped on exit; fails the test if mosquitto is missing."""
    if mosquitto_binary() is None:
        pytest.fail(
            "mosquitto is not installed: `make venv` installs it (Debian package mosquitto)"
        )
    broker = MosquittoBroker(workdir, persistence=persistence, auth=auth, tls=tls)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def mosquitto_broker(tmp_path: Path) -> Iterator[MosquittoBroker]:
    """A mosquitto on a free loopback port for one test (no persistence)."""
    with running_broker(tmp_path) as broker:
        yield broker
